"""Scaling of the foundation: trace + identity rewrite + name_expressions + infer_layouts.

On chains and residual graphs of 1k, 10k and 20k equations, prints ms per 1000 equations for each
stage, the 20k/10k time ratio (goal <= 2.2: linear) and the ratio of the whole to jax.make_jaxpr of
the same function (goal <= 3x). Medians of --repeats runs.

Run: python benchmarks/bench_transform.py [--sizes 1000 10000 20000] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxq
from jaxq import transform as T


def chain(n: int):
    """n equations: a chain of alternating elementwise ops."""

    def f(x):
        for i in range(n):
            x = jnp.sin(x) if i % 2 == 0 else x * 1.5
        return x

    return f


def residual(n: int):
    """About n equations: blocks of 5 (dot, broadcast bias, add, tanh, add skip), named scopes."""
    w = np.full((8, 8), 0.01, np.float32)
    b = np.zeros(8, np.float32)

    def f(x):
        for i in range(n // 5):
            with jax.named_scope(f"Block_{i}"):
                x = x + jnp.tanh(x @ w + b)
        return x

    return f


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(kind: str, n: int, repeats: int) -> dict:
    # a fresh function object per run: jax caches traces by function identity
    make = {"chain": chain, "residual": residual}[kind]
    x = np.ones((4, 8), np.float32)
    prog = jaxq.trace(make(n), x)
    eqns = len(prog)
    ident, names, layouts = T.identity(), T.name_expressions(), T.infer_layouts()
    t_make = _median(lambda: jax.make_jaxpr(make(n))(x), repeats)
    t_trace = _median(lambda: jaxq.trace(make(n), x), repeats)
    t_ident = _median(lambda: ident(prog), repeats)
    t_names = _median(lambda: names(prog), repeats)
    t_lay = _median(lambda: layouts(prog), repeats)
    total = t_trace + t_ident + t_names + t_lay
    return {
        "graph": kind,
        "equations": eqns,
        "make_jaxpr_s": t_make,
        "trace_s": t_trace,
        "identity_s": t_ident,
        "name_expressions_s": t_names,
        "infer_layouts_s": t_lay,
        "total_s": total,
        "ms_per_1k": 1e3 * total / eqns * 1000,
        "vs_make_jaxpr": total / t_make,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 20000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args(argv)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 100_000))

    rows = [measure(kind, n, args.repeats) for kind in ("chain", "residual") for n in args.sizes]
    head = (
        f"{'graph':<9}{'eqns':>7}{'make_jaxpr':>12}{'trace':>9}{'identity':>10}{'names':>8}"
        f"{'layouts':>9}{'total':>9}{'ms/1k':>8}{'x make':>8}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['graph']:<9}{r['equations']:>7}{r['make_jaxpr_s']:>12.3f}{r['trace_s']:>9.3f}"
            f"{r['identity_s']:>10.3f}{r['name_expressions_s']:>8.3f}{r['infer_layouts_s']:>9.3f}"
            f"{r['total_s']:>9.3f}{r['ms_per_1k']:>8.1f}{r['vs_make_jaxpr']:>8.2f}"
        )
    ratios = {}
    for kind in ("chain", "residual"):
        by_n = {r["equations"]: r for r in rows if r["graph"] == kind}
        sizes = sorted(by_n)
        if len(sizes) >= 2:
            big, small = by_n[sizes[-1]], by_n[sizes[-2]]
            ratios[kind] = big["total_s"] / small["total_s"]
            scale = big["equations"] / small["equations"]
            print(
                f"{kind}: time ratio {sizes[-1]}/{sizes[-2]} eqns = {ratios[kind]:.2f} "
                f"(size ratio {scale:.2f}; goal <= 2.2 for 20k/10k)"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "ratios": ratios, "jax": jax.__version__}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
