"""Peers side by side: float, jaxq and qwix on the same trained digits models.

Trains the CNN and MLP of ``examples/digits.py`` once, then quantizes the same weights with jaxq
(``jaxq.quantize``: W8A8 static, W8A8 dynamic, weight-only int8, weight-only int4) and with qwix
(Google's JAX quantization library, ``pip install qwix``: the same schemes through its PTQ provider,
on Flax linen twins of the models that load the trained weights). For each it reports test
accuracy, the relative logit error against float, jitted latency medians at batch 1 and 256, and
parameter bytes, then whether jaxq is at least as accurate as qwix and faster at every batch size.

Weights are passed to the jitted functions as arguments (as a deployment loads them); closed over,
XLA would constant-fold weight-only dequantization back to float weights. Latencies interleave
the methods in rounds so that load from other processes spreads over all of them.

    python benchmarks/bench_peers.py [--models cnn mlp] [--steps 600] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import digits  # noqa: E402

Apply = Callable[[Any, jax.Array], jax.Array]
BATCHES = (1, 256)
SCHEMES = ("W8A8 static", "W8A8 dynamic", "W8 weight-only", "W4 weight-only")


@dataclasses.dataclass(frozen=True)
class Method:
    """A runnable model: ``bind(x)`` gives ``(apply, weights)`` for inputs shaped like ``x``."""

    name: str
    config: str
    bind: Callable[[np.ndarray], tuple[Apply, Any]]
    param_bytes: int
    note: str = ""


@dataclasses.dataclass
class Row:
    """One line of the table (``note`` starts with ``unavailable:`` when the method failed)."""

    model: str
    method: str
    config: str
    accuracy: float | None = None
    rel_logit_err: float | None = None
    latency_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    param_bytes: int | None = None
    bytes_pct_of_float: float | None = None
    note: str = ""


def tree_bytes(tree: Any) -> int:
    """Sum of ``nbytes`` over the array leaves of a pytree."""
    return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


def version(package: str) -> str | None:
    """Installed version of ``package``, or None."""
    try:
        return _version(package)
    except PackageNotFoundError:
        return None


def unavailable(e: BaseException) -> str:
    """``unavailable: Type: first line of the message``."""
    msg = str(e).strip().splitlines()
    return f"unavailable: {type(e).__name__}" + (f": {msg[0][:160]}" if msg else "")


# ---- float ----------------------------------------------------------------------------------------


def float_method(model: str, params: Any) -> Method:
    """The trained model as is."""
    apply = digits.MODELS[model][1]
    return Method("float", "float32", lambda x: (apply, params), tree_bytes(params))


# ---- jaxq -----------------------------------------------------------------------------------------


def jaxq_methods(model: str, params: Any, calib: list[np.ndarray]) -> list[Method | Row]:
    """Every scheme through ``jaxq.quantize`` in realize mode (integer code)."""
    try:
        import jaxq.quantize as jq
    except ImportError as e:
        return [Row(model, f"jaxq {s}", "", note=unavailable(e)) for s in SCHEMES]
    token = jq.Scheme(granularity="token")
    configs = {
        "W8A8 static": (
            jq.QConfig(),
            "QConfig(): w int8 sym channel narrow, a int8 asym tensor minmax",
        ),
        "W8A8 dynamic": (
            jq.QConfig(activations=token, dynamic=True),
            "QConfig(activations=Scheme(granularity='token'), dynamic=True): a int8 sym token",
        ),
        "W8 weight-only": (
            jq.QConfig(activations=None),
            "QConfig(activations=None): w int8 sym channel narrow",
        ),
        "W4 weight-only": (
            jq.QConfig(weights=jq.Scheme(bits=4, granularity="channel"), activations=None),
            "w int4 sym channel (two per byte), activations=None",
        ),
        "W4 weight-only GPTQ": (
            jq.QConfig(
                weights=jq.Scheme(bits=4, granularity="channel"),
                activations=None,
                weight_calibration="gptq",
            ),
            "as W4 weight-only, codes chosen by GPTQ on the calibration batches (dense layers)",
        ),
    }
    f = functools.partial(digits.MODELS[model][1], params)
    out: list[Method | Row] = []
    for scheme, (config, desc) in configs.items():
        name = f"jaxq {scheme}"
        try:
            qf = jq.quantize(f, calibration=[(x,) for x in calib], config=config, progress=False)
        except Exception as e:  # noqa: BLE001 - a failing method becomes a table row
            out.append(Row(model, name, desc, note=unavailable(e)))
            continue

        def bind(x: np.ndarray, qf: Any = qf) -> tuple[Apply, Any]:
            prog = qf.specialize(x)

            def apply(consts: list[jax.Array], x: jax.Array) -> jax.Array:
                flat = jax.core.eval_jaxpr(prog.jaxpr.jaxpr, consts, x)
                return jax.tree.unflatten(prog.out_tree, flat)

            return apply, [jnp.asarray(c) for c in prog.jaxpr.consts]

        out.append(Method(name, desc, bind, qf.report().param_bytes))
    return out


# ---- qwix -----------------------------------------------------------------------------------------


def linen_twin(model: str) -> tuple[Any, Callable[[Any], Any]]:
    """A Flax linen module computing ``digits.<model>``, and a map from its params to linen's."""
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.relu(nn.Conv(16, (3, 3), padding="SAME")(x))
            x = nn.relu(nn.Conv(32, (3, 3), padding="SAME")(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
            x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
            return nn.Dense(10)(x)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = x.reshape(x.shape[0], -1)
            x = nn.relu(nn.Dense(256)(x))
            x = nn.relu(nn.Dense(256)(x))
            return nn.Dense(10)(x)

    layers = {
        "cnn": {"conv0": "Conv_0", "conv1": "Conv_1", "dense0": "Dense_0", "dense1": "Dense_1"},
        "mlp": {"dense0": "Dense_0", "dense1": "Dense_1", "dense2": "Dense_2"},
    }[model]

    def convert(params: Any) -> Any:
        return {
            layers[k]: {"kernel": jnp.asarray(v["w"]), "bias": jnp.asarray(v["b"])}
            for k, v in params.items()
        }

    return {"cnn": CNN, "mlp": MLP}[model](), convert


def qwix_rules(model: str) -> dict[str, tuple[dict[str, Any], str, str]]:
    """Per scheme: ``QuantizationRule`` fields, a description, and a caveat for the table."""
    # qwix's PTQ conv needs act_qtype == weight_qtype, so weight-only rules cover dense layers.
    conv_note = ["convs stay float (qwix PTQ conv needs act_qtype == weight_qtype)"] * (
        model == "cnn"
    )
    w8 = {"weight_qtype": jnp.int8}
    return {
        "W8A8 static": (
            {
                **w8,
                "act_qtype": jnp.int8,
                "act_static_scale": True,
                "act_calibration_method": "minmax",
            },
            "QtProvider stats -> PtqProvider + quantize_params: w int8 absmax channel, "
            "a int8 minmax tensor static (stats averaged over samples and batches)",
            "",
        ),
        "W8A8 dynamic": (
            {**w8, "act_qtype": jnp.int8},
            "PtqProvider: w int8 absmax channel, a int8 absmax dynamic per sample/row",
            "",
        ),
        "W8 weight-only": (
            {**w8, "op_names": ("dot_general",)},
            "PtqProvider: w int8 absmax channel, op_names=(dot_general,)",
            "; ".join(conv_note),
        ),
        "W4 weight-only": (
            {"weight_qtype": jnp.int4, "op_names": ("dot_general",)},
            "PtqProvider: w int4 absmax channel, op_names=(dot_general,)",
            "; ".join([*conv_note, "jax nbytes counts int4 as 1 byte"]),
        ),
    }


def qwix_methods(
    model: str, params: Any, calib: list[np.ndarray], x_check: np.ndarray
) -> list[Method | Row]:
    """Every scheme through qwix's PTQ provider, on a linen twin loaded with the same weights."""
    try:
        import qwix

        module, convert = linen_twin(model)
    except ImportError as e:
        return [Row(model, f"qwix {s}", "", note=unavailable(e)) for s in SCHEMES]
    lparams = convert(params)
    twin = module.apply({"params": lparams}, x_check)
    err = float(jnp.max(jnp.abs(twin - digits.MODELS[model][1](params, x_check))))
    if err > 1e-5:
        e = AssertionError(f"linen twin differs from digits.{model} by {err:.2g}")
        return [Row(model, f"qwix {s}", "", note=unavailable(e)) for s in SCHEMES]

    def apply(qmodel: Any, qparams: Any, x: jax.Array) -> jax.Array:
        return qmodel.apply({"params": qparams}, x)

    out: list[Method | Row] = []
    for scheme, (fields, desc, note) in qwix_rules(model).items():
        name = f"qwix {scheme}"
        try:
            rule = qwix.QuantizationRule(**fields)
            stats: Any = {}
            if rule.act_static_scale:
                qt = qwix.quantize_model(module, qwix.QtProvider([rule]))
                for x in calib:
                    variables = {"params": lparams, "quant_stats": stats}
                    stats = qt.apply(variables, x, mutable=["quant_stats"])[1]["quant_stats"]
            qmodel = qwix.quantize_model(module, qwix.PtqProvider([rule]))
            abstract = jax.eval_shape(qmodel.init, jax.random.key(0), calib[0][:1])
            qparams = qwix.quantize_params(lparams, abstract["params"], stats)
        except Exception as e:  # noqa: BLE001 - a failing method becomes a table row
            out.append(Row(model, name, desc, note=unavailable(e)))
            continue
        fn = functools.partial(apply, qmodel)
        out.append(
            Method(name, desc, lambda x, fn=fn, w=qparams: (fn, w), tree_bytes(qparams), note)
        )
    return out


# ---- measurement --------------------------------------------------------------------------------


def latencies(methods: list[Method], x: np.ndarray, reps: int, rounds: int) -> dict[str, float]:
    """Median milliseconds per call, methods interleaved over ``rounds`` rounds (each round in a
    fresh random order: the method called first in a fixed order ran slower)."""
    calls: dict[str, Callable[[], Any]] = {}
    for m in methods:
        apply, weights = m.bind(x)
        calls[m.name] = functools.partial(jax.jit(apply), jax.device_put(weights), jnp.asarray(x))
        for _ in range(3):
            jax.block_until_ready(calls[m.name]())
    samples: dict[str, list[float]] = {k: [] for k in calls}
    order = np.random.default_rng(0)
    for _ in range(rounds):
        for i in order.permutation(len(methods)):
            k, call = methods[i].name, calls[methods[i].name]
            for _ in range(max(1, reps // rounds)):
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                samples[k].append(time.perf_counter() - t0)
    return {k: 1e3 * float(np.median(v)) for k, v in samples.items()}


def run_model(model: str, data: digits.Data, args: argparse.Namespace) -> list[Row]:
    """Train ``model``, build every method, and measure them."""
    t0 = time.perf_counter()
    params = digits.train(model, data, steps=args.steps)
    print(f"[{model}] trained in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    n = args.calib_batches * args.calib_size
    calib = [data.x_train[i : i + args.calib_size] for i in range(0, n, args.calib_size)]
    built: list[Method | Row] = [float_method(model, params)]
    built += jaxq_methods(model, params, calib)
    built += qwix_methods(model, params, calib, data.x_test[:64])
    methods = [m for m in built if isinstance(m, Method)]
    ref = np.asarray(digits.MODELS[model][1](params, data.x_test))
    lat = {
        b: latencies(methods, data.x_test[:b], args.reps[i], args.rounds)
        for i, b in enumerate(BATCHES)
    }
    float_bytes = methods[0].param_bytes
    rows = []
    for m in built:
        if isinstance(m, Row):
            rows.append(m)
            continue
        apply, weights = m.bind(data.x_test)
        logits = np.asarray(jax.jit(apply)(weights, data.x_test))
        rows.append(
            Row(
                model,
                m.name,
                m.config,
                float(np.mean(np.argmax(logits, -1) == data.y_test)),
                float(np.linalg.norm(logits - ref) / np.linalg.norm(ref)),
                {f"b{b}": lat[b][m.name] for b in BATCHES},
                m.param_bytes,
                100.0 * m.param_bytes / float_bytes,
                m.note,
            )
        )
    print(f"[{model}] done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return rows


# ---- report ---------------------------------------------------------------------------------------


def verdicts(rows: list[Row], n_test: int) -> list[str]:
    """For each scheme: is jaxq at least as accurate as qwix, and faster at every batch size?"""
    by = {(r.model, r.method): r for r in rows}
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        for scheme in (*SCHEMES, "W4 weight-only GPTQ"):
            peer = scheme.removesuffix(" GPTQ")  # qwix's round-to-nearest scheme
            j, q = by.get((model, f"jaxq {scheme}")), by.get((model, f"qwix {peer}"))
            if j is None or q is None or j.accuracy is None or q.accuracy is None:
                if scheme in SCHEMES:
                    lines.append(f"{model} {scheme}: not comparable (a method is unavailable)")
                continue
            images = round((j.accuracy - q.accuracy) * n_test)
            acc = f"{'yes' if images >= 0 else 'NO'} ({images:+d} test images)"
            speed = ", ".join(f"{k} {q.latency_ms[k] / j.latency_ms[k]:.2f}x" for k in j.latency_ms)
            faster = all(j.latency_ms[k] < q.latency_ms[k] for k in j.latency_ms)
            lines.append(
                f"{model} {scheme}: jaxq accuracy >= qwix: {acc}; jaxq faster at every batch: "
                f"{'yes' if faster else 'NO'} (qwix/jaxq time: {speed})"
            )
    return lines


def cells(r: Row) -> tuple[str, ...]:
    """A measured row's table cells."""
    return (
        r.model,
        r.method,
        f"{r.accuracy:.4f}",
        f"{r.rel_logit_err:.2e}",
        *(f"{r.latency_ms[f'b{b}']:.3f}" for b in BATCHES),
        f"{r.param_bytes:,}",
        f"{r.bytes_pct_of_float:.1f}",
    )


def table(rows: list[Row]) -> str:
    """The comparison table, then each row's configuration and caveats."""
    head = ("model", "method", "accuracy", "rel err", "b1 ms", "b256 ms", "param bytes", "% float")
    body = [cells(r) if r.accuracy is not None else (r.model, r.method) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in body if i < len(c))) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    for r, c in zip(rows, body, strict=True):
        lines.append(
            fmt.format(*c) if r.accuracy is not None else fmt.format(*c, r.note, *[""] * 5)
        )
    lines += ["", "configurations:"]
    lines += [
        f"  {r.model} {r.method}: {r.config}" + (f" [{r.note}]" if r.note else "") for r in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=sorted(digits.MODELS), default=["cnn", "mlp"])
    ap.add_argument("--steps", type=int, default=600, help="training steps per model")
    ap.add_argument("--reps", type=int, nargs=2, default=[200, 50], help="timed calls at b1, b256")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--calib-batches", type=int, default=8)
    ap.add_argument("--calib-size", type=int, default=128)
    ap.add_argument("--json", type=Path, help="write the rows and verdicts here")
    args = ap.parse_args(argv)

    data = digits.load()
    rows = [r for model in args.models for r in run_model(model, data, args)]
    print(table(rows))
    print()
    verdict = verdicts(rows, len(data.y_test))
    print("\n".join(verdict))
    if args.json:
        meta = {
            "versions": {p: version(p) for p in ("jax", "jaxlib", "flax", "qwix", "jaxq")},
            "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
        args.json.write_text(
            json.dumps(
                {"meta": meta, "rows": [dataclasses.asdict(r) for r in rows], "verdicts": verdict},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
