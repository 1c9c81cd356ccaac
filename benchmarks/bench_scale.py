"""Quantizing big models with params as arguments: time, peak memory, compile time, a run.

Each model is a stack of transformer MLP blocks (``x + W2 gelu(W1 x)``) with random weights,
written as ``f(params, x)`` over a params dict, as JAX users keep them. Every model runs in a fresh
subprocess, so the peak RSS (``resource.getrusage``) is that model's alone. Compile times are of
``jax.jit(f).lower(params, x).compile()`` (float) and ``jax.jit(qf.apply).lower(qf.params, x)
.compile()`` (int8), both with the weights as arguments, medians of three batch sizes compiled in
turn; run times are medians of calls timed round by round (float, int8, float, int8, ...) on the
same input.

Models: ``small`` (512 MiB f32), ``large`` (1.21 B params, bf16), each as a Python loop of
blocks and, with ``_scan``, as one ``lax.scan`` over stacked params (``small_scan``,
``large_scan``), the way Flax ``nn.scan`` / ``nnx.scan`` layer stacks run.

Configs (``--config``, several comma-separated): ``w8a8`` the default ``QConfig()``;
``w8a8-finite`` without the NaN-row checks (``nan_rows=False``); ``w8a8-sym-finite`` also with
symmetric activations (no zero-point terms); ``w8`` weight-only. Compile time follows the number
of operations XLA sees per layer, which is what these remove: the last line compiles 16 chained
dots in float32, with the quantize and rescale of an int8 layer around each (in float32), and as
int8 x int8 -> int32 dots (measured: the second and third alike, about twice the first).

Run: python benchmarks/bench_scale.py [--models small,large,small_scan,large_scan]
[--config w8a8,w8a8-finite,w8a8-sym-finite,w8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

MODELS = {
    # name: (blocks, d_model, hidden, dtype); "_scan": the same blocks as one lax.scan over
    # stacked params ([blocks, ...] leaves, as Flax nn.scan / nnx.scan keep them)
    "tiny": (2, 256, 512, "float32"),
    "small": (4, 4096, 4096, "float32"),  # 8 x 4096^2 f32 = 512 MiB
    "large": (36, 2048, 8192, "bfloat16"),  # 36 x 2 x 2048 x 8192 = 1.21 B params, 2.4 GB
}
MODELS.update({f"{k}_scan": v for k, v in list(MODELS.items())})
CONFIGS: dict[str, dict[str, Any]] = {
    "w8a8": {},
    "w8a8-finite": {"nan_rows": False},
    "w8a8-sym-finite": {"activations": {"symmetric": True}, "nan_rows": False},
    "w8": {"activations": None},
}
GOALS = {"small": {"quantize_s": 10.0, "peak_rss_mb": 2048.0}, "compile_ratio": 1.5}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def child(name: str, config: str, reps: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxq

    blocks, d, hidden, dtype = MODELS[name]
    rng = np.random.default_rng(0)
    scanned = name.endswith("_scan")
    w1 = lambda: jnp.asarray(rng.standard_normal((d, hidden), np.float32) / np.sqrt(d), dtype)
    w2 = lambda: jnp.asarray(rng.standard_normal((hidden, d), np.float32) / np.sqrt(hidden), dtype)
    params: dict[str, Any] = {}
    if scanned:  # two stacked leaves, filled layer by layer on the host
        stacked = {
            "w1": np.empty((blocks, d, hidden), jnp.dtype(dtype)),
            "w2": np.empty((blocks, hidden, d), jnp.dtype(dtype)),
        }
        for i in range(blocks):
            stacked["w1"][i], stacked["w2"][i] = w1(), w2()
        params = {k: jnp.asarray(v) for k, v in stacked.items()}
        del stacked
    for i in range(0 if scanned else blocks):  # leaf by leaf: no float copy besides params
        params[f"block_{i}"] = {"w1": w1(), "w2": w2()}

    def block(x: jax.Array, p: dict[str, Any]) -> jax.Array:
        return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]

    def f(params: dict[str, Any], x: jax.Array) -> jax.Array:
        if scanned:
            return jax.lax.scan(lambda x, p: (block(x, p), None), x, params)[0]
        for i in range(len(params)):
            with jax.named_scope(f"block_{i}"):
                x = block(x, params[f"block_{i}"])
        return x

    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    float_bytes = sum(v.nbytes for v in jax.tree.leaves(params))
    x = jnp.asarray(rng.standard_normal((8, d), np.float32), dtype)
    calib = [(jnp.asarray(rng.standard_normal((8, d), np.float32), dtype),) for _ in range(2)]
    fields = dict(CONFIGS[config])
    if isinstance(fields.get("activations"), dict):
        fields["activations"] = jaxq.Scheme(**fields["activations"])
    cfg = jaxq.QConfig(**fields)
    rss_before = rss_mb()
    t0 = time.perf_counter()
    qf = jaxq.quantize(f, params, calibration=calib, config=cfg, progress=False)
    quantize_s = time.perf_counter() - t0
    peak_quantize = rss_mb()
    q_bytes = qf.report().param_bytes

    # compile times: the median of 3 compiles each, interleaved, of programs for 3 batch sizes
    # (no compile cache hit; one compile alone varied by 30% here)
    compiles: dict[str, list[float]] = {"float": [], "int8": []}
    for rows in (9, 10, 8):
        xs = jnp.zeros((rows, d), dtype)
        for key, fn, p in (("float", f, params), ("int8", qf.apply, qf.params)):
            t0 = time.perf_counter()
            compiled = jax.jit(fn).lower(p, xs).compile()
            compiles[key].append(time.perf_counter() - t0)
            if key == "float":
                float_fn = compiled
            else:
                int8_fn = compiled
    float_compile = statistics.median(compiles["float"])
    int8_compile = statistics.median(compiles["int8"])

    y_f = np.asarray(float_fn(params, x), np.float32)
    y_q = np.asarray(int8_fn(qf.params, x), np.float32)
    times: dict[str, list[float]] = {"float": [], "int8": []}
    for _ in range(reps):
        for key, fn, p in (("float", float_fn, params), ("int8", int8_fn, qf.params)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(p, x))
            times[key].append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(times["float"], times["int8"], strict=True)]
    return {
        "model": name,
        "config": config,
        "params": n_params,
        "dtype": dtype,
        "float_mb": float_bytes / 2**20,
        "quantized_mb": q_bytes / 2**20,
        "quantize_s": quantize_s,
        "rss_before_quantize_mb": rss_before,
        "peak_rss_quantize_mb": peak_quantize,
        "peak_rss_mb": rss_mb(),
        "float_compile_s": float_compile,
        "int8_compile_s": int8_compile,
        "compile_ratio": int8_compile / float_compile,
        "float_ms": 1e3 * statistics.median(times["float"]),
        "int8_ms": 1e3 * statistics.median(times["int8"]),
        "speedup": statistics.median(ratios),
        "rel_error": float(np.abs(y_q - y_f).max() / np.abs(y_f).max()),
    }


def dot_compiles(n: int = 16, d: int = 256) -> dict[str, float]:
    """Seconds XLA takes to compile ``n`` chained ``[8, d] x [d, d]`` dots with a tanh between
    (medians of 5, interleaved): ``float`` as they are; ``float+q`` with the quantize (round,
    clip) before each dot and the rescale after it, all in float32; ``int8`` the same with
    int8 x int8 -> int32 dots. What separates an int8 program's compile time from float's."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def chain(kind: str) -> Any:
        def f(ws: list[jax.Array], x: jax.Array) -> jax.Array:
            for w in ws:
                if kind == "float":
                    x = jnp.tanh(x @ w)
                    continue
                q = jnp.clip(jnp.round(x * 10), -127, 127)
                if kind == "int8":
                    dn = (((1,), (0,)), ((), ()))
                    acc = lax.dot_general(
                        q.astype(jnp.int8), w, dn, preferred_element_type=jnp.int32
                    )
                    x = jnp.tanh(acc.astype(jnp.float32) * 0.01)
                else:
                    x = jnp.tanh((q @ w) * 0.01)
            return x

        return f

    out: dict[str, list[float]] = {"float": [], "float+q": [], "int8": []}
    jax.jit(lambda a: a + 1).lower(jnp.zeros(3)).compile()  # (XLA's one-time start-up)
    for rows in range(8, 13):  # (a new program each time: no compile cache hit)
        x = jnp.zeros((rows, d))  # (made outside the timing: a new shape compiles zeros)
        for key in out:
            dtype = jnp.int8 if key == "int8" else jnp.float32
            ws = [jnp.full((d, d), i % 5 - 2, dtype) for i in range(n)]
            t0 = time.perf_counter()
            jax.jit(chain(key)).lower(ws, x).compile()
            out[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in out.items()}


def verdicts(row: dict[str, Any]) -> list[str]:
    out = [
        f"compile within {GOALS['compile_ratio']}x of float: "
        f"{'met' if row['compile_ratio'] <= GOALS['compile_ratio'] else 'NOT met'}"
    ]
    goal = GOALS.get(row["model"].removesuffix("_scan"))
    if isinstance(goal, dict):
        ok = (
            row["quantize_s"] <= goal["quantize_s"]
            and row["peak_rss_quantize_mb"] <= goal["peak_rss_mb"]
        )
        out.append(
            f"quantize <= {goal['quantize_s']:.0f} s with peak RSS <= {goal['peak_rss_mb']:.0f} MB: "
            f"{'met' if ok else 'NOT met'}"
        )
    if row["model"].startswith("large"):
        out.append("quantizes and runs on this machine: met")
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,large")
    ap.add_argument("--model", help=argparse.SUPPRESS)  # (the subprocess's own job)
    ap.add_argument("--config", default="w8a8", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    configs = args.config.split(",")
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"--config {c!r}: choose from {', '.join(CONFIGS)}")
    if args.model == "dots":
        print(json.dumps(dot_compiles()))
        return []
    if args.model:
        print(json.dumps(child(args.model, args.config, args.reps)))
        return []
    rows = []
    for name in args.models.split(","):
        for config in configs:
            cmd = [sys.executable, __file__, "--model", name, "--config", config]
            done = subprocess.run([*cmd, "--reps", str(args.reps)], capture_output=True, text=True)
            if done.returncode:
                print(f"{name} {config}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    head = (
        f"{'model':<11}{'config':>16}{'params':>9}{'dtype':>10}{'float MB':>10}{'int8 MB':>9}{'quantize s':>12}"
        f"{'peak RSS MB':>13}{'compile f/q s':>15}{'ratio':>7}{'run f/q ms':>15}{'speed':>7}"
        f"{'rel err':>9}"
    )
    print(f"weights are arguments of every compiled function\n{head}")
    for r in rows:
        print(
            f"{r['model']:<11}{r['config']:>16}{r['params'] / 1e9:>8.2f}B{r['dtype']:>10}{r['float_mb']:>10.0f}"
            f"{r['quantized_mb']:>9.0f}{r['quantize_s']:>12.1f}{r['peak_rss_quantize_mb']:>13.0f}"
            f"{r['float_compile_s']:>7.2f}/{r['int8_compile_s']:<7.2f}{r['compile_ratio']:>7.2f}"
            f"{r['float_ms']:>7.1f}/{r['int8_ms']:<7.1f}{r['speedup']:>6.2f}x{r['rel_error']:>9.4f}"
        )
        for v in verdicts(r):
            print(f"  {r['model']} {r['config']}: {v}")
    print(
        "(peak RSS: the process's peak at the end of quantize, params included; run: medians "
        "of interleaved calls, 'speed' the median per-round float/int8 ratio)"
    )
    done = subprocess.run([sys.executable, __file__, "--model", "dots"], capture_output=True)
    if done.returncode == 0:
        dots = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"16 chained 256 x 256 dots compile in {dots['float']:.2f} s in float32, "
            f"{dots['float+q']:.2f} s with a quantize before and a rescale after each (still "
            f"float32), {dots['int8']:.2f} s with int8 x int8 -> int32 dots: the quantize "
            "arithmetic, not the int8 kernel, is what an int8 program adds"
        )
        rows.append({"model": "dots", **dots})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return rows


if __name__ == "__main__":
    main()
