"""Model breadth: jaxq's pipelines on real architectures (see model_zoo.py).

Per model: equations, whether each pipeline ran, its transform time, and the error of its output
against the float model (jitted both sides): max absolute error and relative L2 error. Pipelines:
``structural`` (identity rewrite + name_expressions + infer_layouts: must be exact), ``q-simulate``
and ``q-realize`` (jaxq.quantize with the default W8A8 config, calibrated on the example input),
``partition`` (annotate / merge / partition for a BYOC compiler, run by jaxq.build: exact).

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
from jaxq import partition as P  # noqa: E402
from jaxq import transform as T  # noqa: E402


def structural(f: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    program = jaxq.trace(f, *args)
    pipeline = T.Sequential([T.identity(), T.name_expressions(), T.infer_layouts()])
    return pipeline(program).as_fun()


def quantize_simulate(f: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    return jaxq.quantize(f, calibration=[args], mode="simulate", progress=False)


def quantize_realize(f: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    return jaxq.quantize(f, calibration=[args], mode="realize", progress=False)


def partition(f: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    """Every dot_general / conv / elementwise op goes to an XLA-backed "byoc" compiler region."""
    for prim in ("dot_general", "conv_general_dilated", "add", "mul", "max", "tanh", "exp"):
        P.register_op_support("byoc", prim)
    pipeline = T.Sequential(
        [P.annotate_target(["byoc"]), P.merge_compiler_regions(), P.partition_graph()]
    )
    return jaxq.build(pipeline(jaxq.trace(f, *args)), backends={"byoc": "xla"})


PIPELINES: dict[str, Callable[[Callable[..., Any], tuple[Any, ...]], Callable[..., Any]]] = {
    "structural": structural,
    "q-simulate": quantize_simulate,
    "q-realize": quantize_realize,
    "partition": partition,
}


def _errors(a: Any, b: Any) -> tuple[float, float]:
    x = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(a)])
    y = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(b)])
    rel = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
    return float(np.max(np.abs(x - y))), rel


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
            row["max_abs_err"], row["rel_err"] = _errors(jax.jit(g)(*args), ref)
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
    print(
        f"{'model':<24}{'pipeline':<12}{'eqns':>7}{'time s':>9}{'max err':>11}{'rel err':>10}"
        "  status"
    )
    for r in rows:
        t = f"{r['transform_s']:.3f}" if "transform_s" in r else "-"
        e = f"{r['max_abs_err']:.2e}" if "max_abs_err" in r else "-"
        rel = f"{r['rel_err']:.2e}" if "rel_err" in r else "-"
        print(
            f"{r['model']:<24}{r['pipeline']:<12}{r.get('equations', '-'):>7}{t:>9}{e:>11}"
            f"{rel:>10}  {r['status']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return int(any(r["status"].startswith("FAILED") for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())
