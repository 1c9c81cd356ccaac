"""Model breadth: jaxq's pipelines on real architectures (see model_zoo.py).

Per model: equations, whether each pipeline ran, its transform time, and the max output error
against the float model (jitted both sides). Pipelines: ``structural`` (identity rewrite +
name_expressions + infer_layouts, must be exact) plus whatever later stages are installed.

Run: python benchmarks/bench_models.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from model_zoo import MODELS  # noqa: E402

import jaxq  # noqa: E402
from jaxq import transform as T  # noqa: E402


def structural(f: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    program = jaxq.trace(f, *args)
    pipeline = T.Sequential([T.identity(), T.name_expressions(), T.infer_layouts()])
    return pipeline(program).as_fun()


PIPELINES: dict[str, Callable[[Callable[..., Any], tuple[Any, ...]], Callable[..., Any]]] = {
    "structural": structural,
}


def _max_err(a: Any, b: Any) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def run(name: str, build: Callable[[], Any]) -> list[dict[str, Any]]:
    try:
        f, args = build()
    except ImportError as e:
        return [{"model": name, "pipeline": "-", "status": f"skipped ({e.name} not installed)"}]
    ref = jax.jit(f)(*args)
    eqns = len(jaxq.trace(f, *args))
    rows = []
    for pname, pipeline in PIPELINES.items():
        row: dict[str, Any] = {"model": name, "pipeline": pname, "equations": eqns}
        try:
            t0 = time.perf_counter()
            g = pipeline(f, args)
            row["transform_s"] = time.perf_counter() - t0
            row["max_abs_err"] = _max_err(jax.jit(g)(*args), ref)
            row["status"] = "ok"
        except Exception as e:  # the sweep reports failures instead of stopping
            row["status"] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            row["traceback"] = traceback.format_exc()
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="model names to run")
    args = ap.parse_args(argv)
    rows = []
    for name, build in MODELS.items():
        if args.only and name not in args.only:
            continue
        rows.extend(run(name, build))
    print(f"{'model':<24}{'pipeline':<12}{'eqns':>7}{'time s':>9}{'max err':>11}  status")
    for r in rows:
        t = f"{r['transform_s']:.3f}" if "transform_s" in r else "-"
        e = f"{r['max_abs_err']:.2e}" if "max_abs_err" in r else "-"
        print(
            f"{r['model']:<24}{r['pipeline']:<12}{r.get('equations', '-'):>7}{t:>9}{e:>11}  "
            f"{r['status']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return int(any(r["status"].startswith("FAILED") for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())
