"""Time annotate_target + merge_compiler_regions + partition_graph on big programs.

Graphs: a *chain* (x -> op -> op -> ...) and a *residual* stack (blocks ``y = x + g(f(x))``), with
``cos`` unsupported every ``--every`` equations so merging has restrictions to honour. Prints a table
(equations, wall seconds per pass, total wall and CPU seconds, regions; best of ``--repeat`` runs by
wall time, taken round-robin over the sizes, garbage collector on) and the goals; ``--json PATH`` writes the rows. CPU time is shown
because wall time on a shared machine swings with its load.

    python benchmarks/bench_partition.py [--sizes 1000 3000 10000 20000] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jaxq  # noqa: E402
from jaxq import partition as P  # noqa: E402

SUPPORTED = ("sin", "tanh", "add", "mul")


def chain(n: int, every: int):
    def f(x):
        for i in range(n):
            if every and i % every == every - 1:
                x = jnp.cos(x)
            elif i % 3 == 0:
                x = jnp.sin(x)
            elif i % 3 == 1:
                x = x * 0.5
            else:
                x = jnp.tanh(x)
        return x

    return f


def residual(n: int, every: int):
    def f(x):
        i = 0
        while i < n:
            h = jnp.cos(x) if every and (i // 3) % max(every // 3, 1) == 0 else jnp.sin(x)
            h = jnp.tanh(h)
            x = x + h  # three equations a block
            i += 3
        return x

    return f


def run(kind: str, sizes: list[int], every: int, repeat: int) -> list[dict]:
    """Time every size of one graph kind. Repeats go round-robin over the sizes (all programs are
    traced first), so a burst of load on a shared machine hits every size alike; the best repeat
    of each size counts."""
    make = chain if kind == "chain" else residual
    progs = [jaxq.trace(make(n, every), jax.ShapeDtypeStruct((4,), jnp.float32)) for n in sizes]
    passes = [
        P.annotate_target(["bench"]),
        P.merge_compiler_regions(),
        P.partition_graph(),
    ]
    best: list[Any] = [None] * len(sizes)
    for _ in range(repeat):
        for k, prog in enumerate(progs):
            gc.collect()  # start every repeat from the same heap
            times, cpu, p = [], 0.0, prog
            for ps in passes:
                t0, c0 = time.perf_counter(), time.process_time()
                p = ps(p)
                times.append(time.perf_counter() - t0)
                cpu += time.process_time() - c0
            if best[k] is None or sum(times) < sum(best[k][0]):
                best[k] = (times, len(P.regions(p)), cpu)
    rows = []
    for prog, (times, num_regions, cpu) in zip(progs, best, strict=True):
        rows.append(
            {
                "graph": kind,
                "equations": len(prog.jaxpr.jaxpr.eqns),
                "annotate_s": times[0],
                "merge_s": times[1],
                "partition_s": times[2],
                "total_s": sum(times),
                "cpu_s": cpu,
                "regions": num_regions,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 3000, 10000, 20000])
    ap.add_argument("--every", type=int, default=10, help="an unsupported cos every N equations")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument(
        "--no-gc", action="store_true", help="time with the garbage collector off (as timeit does)"
    )
    args = ap.parse_args()
    if args.no_gc:
        gc.disable()
    for prim in SUPPORTED:
        P.register_op_support("bench", prim)
    rows = [r for k in ("chain", "residual") for r in run(k, args.sizes, args.every, args.repeat)]
    head = (
        f"{'graph':<9} {'eqns':>6} {'annotate':>9} {'merge':>8} {'partition':>9} {'total s':>8} "
        f"{'cpu s':>7} {'regions':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['graph']:<9} {r['equations']:>6} {r['annotate_s']:>9.3f} {r['merge_s']:>8.3f} "
            f"{r['partition_s']:>9.3f} {r['total_s']:>8.3f} {r['cpu_s']:>7.3f} {r['regions']:>7}"
        )
    goals = {}
    for kind in ("chain", "residual"):
        for col in ("total_s", "cpu_s"):
            by = {r["equations"]: r[col] for r in rows if r["graph"] == kind}
            sizes = sorted(by)
            if len(sizes) >= 2:
                a, b = sizes[-2], sizes[-1]
                what = "wall" if col == "total_s" else "cpu"
                key = f"{kind} {b}/{a} {what} time ratio (size ratio {b / a:.1f}, goal <= 2.2)"
                goals[key] = by[b] / by[a]
    chain3k = [r for r in rows if r["graph"] == "chain" and 2500 <= r["equations"] <= 3500]
    if chain3k:
        goals["chain ~3000 equations, total wall seconds (goal <= 0.6)"] = chain3k[0]["total_s"]
    print()
    for k, v in goals.items():
        print(f"{k}: {v:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "rows": rows,
                    "goals": goals,
                    "gc": not args.no_gc,
                    "jax": jax.__version__,
                    "numpy": np.__version__,
                },
                fh,
                indent=2,
            )


if __name__ == "__main__":
    main()
