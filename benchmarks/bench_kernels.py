"""The XLA:CPU kernel facts behind realize's lowering choices, measured on the running jaxlib.

realize picks, per layer, between an int8 x int8 -> int32 kernel and exact integer sums carried in
float32 (and, for convolutions with very few products per output, shifted slices). Which is faster
is a fact about one XLA build, and it changes between versions (jax 0.10.2 and 0.12 differ by 2x on
the same s8 dot). This script measures each choice on the shapes that decide it, every variant
timed round by round on the same inputs (paired ratios: median of per-round time / float time),
and prints the ``jaxq.quantize.tuning`` entry the measurements imply next to the one in use:

    python benchmarks/bench_kernels.py [--json PATH] [--reps 60] [--models-only | --pieces-only]

The table in ``jaxq/quantize/_tuning.py`` holds one entry per jaxlib version and kind of CPU (with
or without VNNI, printed here), chosen at import; paste a new version's printed entry there.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxq
from jaxq import _cpu
from jaxq.quantize import Tuning, tuning
from jaxq.transform import PassContext

DN = ("NHWC", "HWIO", "NHWC")
CONVS = (
    (4, 32),
    (8, 32),
    (16, 8),
    (16, 16),
    (16, 32),
    (32, 16),
    (32, 32),
    (32, 64),
    (64, 16),
    (64, 64),
)
"""(input, output) channels of the measured convolutions: few on either side are the question."""


def paired(
    fs: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]], reps: int
) -> dict[str, dict[str, float]]:
    """Median ms of each variant ``name: (function, args)`` and its median per-round time ratio
    to the first one (below 1 is faster)."""
    table = jaxq.compare_timing(
        {k: functools.partial(f, *a) for k, (f, a) in fs.items()}, rounds=reps
    )
    return {r.name: {"ms": r.ms, "ratio": 1 / r.speedup} for r in table.rows}


def codes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(-127, 128, size=shape).astype(np.int8)


def dots(rng: np.random.Generator, reps: int) -> list[dict[str, Any]]:
    """Matmuls of M rows: float, s8 x s8 -> s32, and the codes' exact sums carried in f32."""
    f32 = jax.jit(lambda x, w: x @ w)
    s8 = jax.jit(lambda x, w: lax.dot(x, w, preferred_element_type=jnp.int32).astype(jnp.float32))
    s8_dup = jax.jit(  # one row duplicated, so the kernel sees two (realize's fallback)
        lambda x, w: lax.dot(jnp.concatenate([x, x]), w, preferred_element_type=jnp.int32)[:1]
    )
    carry = jax.jit(lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32))
    rows = []
    for k, n in ((512, 64), (512, 512), (1024, 1024)):
        for m in (1, 2, 4, 8, 32, 256):
            xf, wf = (
                rng.normal(size=(m, k)).astype(np.float32),
                rng.normal(size=(k, n)).astype(np.float32),
            )
            xi, wi = codes(rng, (m, k)), codes(rng, (k, n))
            fs = {
                "float": (f32, (xf, wf)),
                "s8": (s8, (xi, wi)),
                "f32 carry": (carry, (xi, wi)),
            }
            if m == 1:
                fs["s8 2 rows"] = (s8_dup, (xi, wi))
            rows.append({"op": "dot", "shape": f"{m}x{k} @ {k}x{n}", "m": m, **paired(fs, reps)})
    return rows


def convs(rng: np.random.Generator, reps: int) -> list[dict[str, Any]]:
    """3x3 NHWC convolution layers as realize writes them: the convolution (float; s8 -> s32; or
    the codes' exact sums carried in f32) on a zero-padded input, times scales, plus bias, ReLU,
    then (``pool``) a 2x2 max pooling, and the next layer's quantize (int8 routes). The pooling
    decides: XLA:CPU fuses a float convolution with its epilogue and pooling."""

    def conv(x: jax.Array, w: jax.Array, pref: Any = None) -> jax.Array:
        return lax.conv_general_dilated(
            x, w, (1, 1), "VALID", dimension_numbers=DN, preferred_element_type=pref
        )

    def layer(acc: jax.Array, s: jax.Array, b: jax.Array, pool: bool) -> jax.Array:
        y = jax.nn.relu(acc * s + b)
        if pool:
            y = lax.reduce_window(y, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return y

    def requantize(y: jax.Array) -> jax.Array:
        return jnp.clip(jnp.round(y / jnp.float32(0.05)) - 3, -128, 127).astype(jnp.int8)

    rows = []
    for pool in (False, True):
        f32 = jax.jit(lambda x, w, s, b, p=pool: layer(conv(x, w), 1.0, b, p))
        s8 = jax.jit(
            lambda x, w, s, b, p=pool: requantize(
                layer(conv(x, w, jnp.int32).astype(jnp.float32), s, b, p)
            )
        )
        carry = jax.jit(
            lambda x, w, s, b, p=pool: requantize(
                layer(conv(x.astype(jnp.float32) + 3, w.astype(jnp.float32)), s, b, p)
            )
        )
        for batch in (256, 8):
            for cin, cout in CONVS:
                shape = (batch, 10, 10, cin)
                xf = rng.normal(size=shape).astype(np.float32)
                wf = rng.normal(size=(3, 3, cin, cout)).astype(np.float32)
                xi, wi = codes(rng, shape), codes(rng, (3, 3, cin, cout))
                scale = (rng.random(cout) * 1e-3).astype(np.float32)
                bias = rng.normal(size=cout).astype(np.float32)
                fs = {
                    "float": (f32, (xf, wf, scale, bias)),
                    "s8": (s8, (xi, wi, scale, bias)),
                    "f32 carry": (carry, (xi, wi, scale, bias)),
                }
                rows.append(
                    {
                        "op": "conv",
                        "shape": f"{batch}x8x8 {cin}->{cout}{' pool' if pool else ''}",
                        "batch": batch,
                        "cin": cin,
                        "cout": cout,
                        "pool": pool,
                        **paired(fs, reps),
                    }
                )
    return rows


def _cost(rows: list[dict[str, Any]], pick: Callable[[dict[str, Any]], str]) -> float:
    """Total log time ratio to float of the variants a rule picks (lower is faster)."""
    return sum(math.log(r[pick(r)]["ratio"]) for r in rows)


ROUTES = {
    "f32 carry": Tuning(float_carry_max_rows=1, s8_conv_min_channels=17),
    "s8 2 rows": Tuning(float_carry_max_rows=0, s8_pad_single_row=True, s8_conv_min_channels=17),
    "s8": Tuning(float_carry_max_rows=0, s8_pad_single_row=False, s8_conv_min_channels=17),
}
"""The routes a one-row matmul can take: what decides them is whole models at batch 1 (the
route's extra ops cost as much as the dot there), not a lone dot."""


def one_row_models(rng: np.random.Generator, reps: int) -> list[dict[str, Any]]:
    """A W8A8 MLP (64 -> 512 -> 512 -> 10, biases, ReLU) at batch 1, weights closed over and as
    params, realized by each route, timed against float."""
    sizes = (64, 512, 512, 10)
    params = [
        ((rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), np.full(b, 0.1, np.float32))
        for a, b in zip(sizes, sizes[1:], strict=False)
    ]

    def mlp(params: list[Any], x: jax.Array) -> jax.Array:
        for i, (w, b) in enumerate(params):
            with jax.named_scope(f"Dense_{i}"):
                x = x @ w + b
                x = jax.nn.relu(x) if i < len(params) - 1 else x
        return x

    calib = [(rng.normal(size=(32, 64)).astype(np.float32),)]
    x1 = rng.normal(size=(1, 64)).astype(np.float32)
    rows = []
    for style in ("closure", "params"):
        f_jit = jax.jit(mlp)
        fs: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {"float": (f_jit, (params, x1))}
        for route, tune in ROUTES.items():
            with PassContext(config={"quantize.tuning": tune}):
                if style == "closure":
                    qf = jaxq.quantize(
                        functools.partial(mlp, params), calibration=calib, progress=False
                    )
                    fs[route] = (jax.jit(qf), (x1,))
                else:
                    qf = jaxq.quantize(mlp, params, calibration=calib, progress=False)
                    fs[route] = (jax.jit(qf.apply), (qf.params, x1))
                # (traced by this route now: jit's cache keeps that program; traced at the first
                # timed call, outside this context, every route ran the table's own entry)
                fs[route][0](*fs[route][1])
        rows.append({"op": "model", "shape": f"mlp {style} b1", "m": 1, **paired(fs, 5 * reps)})
    return rows


PIECES = (0, 64, 128, 256)
"""Candidate ``Tuning.weight_pieces``: contracted rows dequantized per loop turn (0: whole)."""


def weight_pieces(rng: np.random.Generator, reps: int) -> list[dict[str, Any]]:
    """Two weight-only W8 transformer MLP blocks (``x + gelu(x @ w1) @ w2``, weights as params)
    at a few rows, realized with each candidate ``weight_pieces``, timed against float. (A lone
    layer does not show it: XLA converts its weight as fast either way.)"""
    rows = []
    for d, h in ((768, 3072), (2048, 8192)):
        params = [
            {
                "w1": (rng.normal(size=(d, h)) / np.sqrt(d)).astype(np.float32),
                "w2": (rng.normal(size=(h, d)) / np.sqrt(h)).astype(np.float32),
            }
            for _ in range(2)
        ]

        def f(params: list[Any], x: jax.Array) -> jax.Array:
            for p in params:
                x = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
            return x

        for m in (1, 8, 64):
            x = rng.normal(size=(m, d)).astype(np.float32)
            fs: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
                "float": (jax.jit(f), (jax.device_put(params), x))
            }
            for pieces in PIECES:
                tune = dataclasses.replace(tuning(), weight_pieces=pieces)
                with PassContext(config={"quantize.tuning": tune}):
                    config = jaxq.QConfig(activations=None)
                    qf = jaxq.quantize(f, params, example_args=(x,), config=config, progress=False)
                    run = jax.jit(qf.apply)
                    run(qf.params, x)  # (traced with this entry: jit's cache keeps that program)
                fs[f"pieces {pieces}"] = (run, (qf.params, x))
            shape = f"{m}x{d}, {d}->{h}->{d} x2"
            rows.append({"op": "w8", "shape": shape, "m": m, **paired(fs, reps)})
    return rows


def implied(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The tuning entry the measurements imply (see ``jaxq.quantize.Tuning``): of each rule's
    candidate thresholds, the one whose picks cost least over the measured shapes."""
    # one row: decided on whole models where measured, else on the lone dots
    models = [r for r in rows if r["op"] == "model"]
    dot = [r for r in rows if r["op"] == "dot" and not (models and r["m"] == 1)]
    one = models or [r for r in dot if r["m"] == 1]
    pad = _cost(one, lambda r: "s8 2 rows") <= _cost(one, lambda r: "s8")
    fallback = "s8 2 rows" if pad else "s8"
    route = lambda c: lambda r: "f32 carry" if r["m"] <= c else fallback if r["m"] == 1 else "s8"
    carry = min(
        (0, *sorted({r["m"] for r in dot + one})),
        key=lambda c: (_cost(dot + one, route(c)), c),
    )
    widest = lambda r: max(r["cin"], r["cout"])

    def channels(conv: list[dict[str, Any]]) -> int:
        return min(
            sorted({widest(r) + 1 for r in conv} | {1}),
            key=lambda t: (_cost(conv, lambda r: "s8" if widest(r) >= t else "f32 carry"), t),
        )

    conv = [r for r in rows if r["op"] == "conv"]
    w8 = [r for r in rows if r["op"] == "w8"]
    entry = {
        "float_carry_max_rows": carry,
        "s8_pad_single_row": pad,
        "s8_conv_min_channels": channels([r for r in conv if not r.get("pool")]),
        "s8_pooled_conv_min_channels": channels([r for r in conv if r.get("pool")]),
    }
    if w8:
        entry["weight_pieces"] = min(PIECES, key=lambda c: (_cost(w8, lambda r: f"pieces {c}"), c))
    return entry


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--json", default=None)
    ap.add_argument("--models-only", action="store_true", help="only the one-row models")
    ap.add_argument("--pieces-only", action="store_true", help="only the weight-only pieces")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.pieces_only:
        rows = weight_pieces(rng, args.reps)
    else:
        rows = one_row_models(rng, args.reps)
        if not args.models_only:
            rows += dots(rng, args.reps) + convs(rng, args.reps) + weight_pieces(rng, args.reps)
    vnni = _cpu.x86_vnni()
    cpu = {
        True: "x86 with VNNI",
        False: "x86 without VNNI (AVX2)",
        None: "not told (not x86, or no /proc/cpuinfo)",
    }
    print(
        f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, {cpu[vnni]}; time / float time, "
        "paired medians"
    )
    print(f"{'op':<6}{'shape':<26}{'float ms':>10}{'s8':>8}{'f32 carry':>11}{'s8 2 rows':>11}")
    for r in (r for r in rows if r["op"] != "w8"):
        dup = f"{r['s8 2 rows']['ratio']:>11.2f}" if "s8 2 rows" in r else ""  # (one row)
        print(
            f"{r['op']:<6}{r['shape']:<26}{r['float']['ms']:>10.3f}{r['s8']['ratio']:>8.2f}"
            f"{r['f32 carry']['ratio']:>11.2f}{dup}"
        )
    w8 = [r for r in rows if r["op"] == "w8"]
    if w8:
        print(f"\nweight-only W8, by Tuning.weight_pieces\n{'shape':<26}{'float ms':>10}", end="")
        print("".join(f"{c:>8}" for c in PIECES))
        for r in w8:
            ratios = "".join(f"{r[f'pieces {c}']['ratio']:>8.2f}" for c in PIECES)
            print(f"{r['shape']:<26}{r['float']['ms']:>10.3f}{ratios}")
    entry = implied(rows)
    if args.pieces_only:  # (the other fields have no measurements behind them)
        entry = {"weight_pieces": entry["weight_pieces"]}
    print(f"\nimplied entry: {entry}")
    print(f"in use:        {tuning()}")
    out = {"jax": jax.__version__, "vnni": vnni, "rows": rows, "implied": entry}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
