"""The main job: train a CNN on scikit-learn's digits, quantize it to int8 with jaxq, compare.

1. trains a small CNN on the digits (shipped inside scikit-learn, no download) in seconds;
2. quantizes it with ``jaxq.quantize(apply, params, ...)`` (W8A8 static: int8 per-channel weights,
   int8 activations
   calibrated on training images), which runs real int8 x int8 -> int32 XLA dots and convolutions;
3. prints float vs int8 test accuracy, jitted CPU latency at batch 1 and 256, parameter bytes, and
   the per-layer report with each layer's SQNR, worst first;
4. saves the int8 model to one file and runs it back without the model code.

Run: python examples/quantize_digits.py [--steps 600] [--model cnn|mlp] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

import jaxq

sys.path.insert(0, str(Path(__file__).parent))
import digits  # noqa: E402


def median_ms(fs: list[Callable[[Any], Any]], x: np.ndarray, runs: int) -> list[float]:
    """Median latency of each function, the calls interleaved so that load from elsewhere on the
    machine falls on all of them alike."""
    for f in fs:
        jax.block_until_ready(f(x))
    times: list[list[float]] = [[] for _ in fs]
    for _ in range(runs):
        for f, ts in zip(fs, times, strict=True):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            ts.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(ts) for ts in times]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(digits.MODELS), default="cnn")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--out", default="results", help="where the model file and charts go")
    args = ap.parse_args(argv)

    data = digits.load()
    t0 = time.perf_counter()
    params = digits.train(args.model, data, steps=args.steps)
    apply = digits.MODELS[args.model][1]
    f = functools.partial(apply, params)
    print(
        f"trained {args.model.upper()} on {len(data.x_train)} digits in "
        f"{time.perf_counter() - t0:.1f}s"
    )

    calibration = [(data.x_train[i : i + 128],) for i in range(0, 512, 128)]
    t0 = time.perf_counter()
    qf = jaxq.quantize(
        apply, params, calibration=calibration, config=jaxq.QConfig(), progress=False
    )
    print(
        f"quantized (annotate + calibrate on {len(calibration)} batches + realize) in "
        f"{time.perf_counter() - t0:.1f}s\n"
    )

    # weights are arguments of both compiled functions (as a served model keeps them)
    float_apply, int8_apply = jax.jit(apply), jax.jit(qf.apply)
    f_jit = lambda x: float_apply(params, x)
    q_jit = lambda x: int8_apply(qf.params, x)
    acc_f = digits.accuracy(f_jit, data.x_test, data.y_test)
    acc_q = digits.accuracy(q_jit, data.x_test, data.y_test)
    b1, b256 = data.x_test[:1], np.concatenate([data.x_test] * 2)[:256]
    (f1, q1), (f256, q256) = median_ms([f_jit, q_jit], b1, 300), median_ms([f_jit, q_jit], b256, 50)
    rows = [
        ("float32", acc_f, f1, f256, sum(np.asarray(p).nbytes for p in jax.tree.leaves(params))),
        ("jaxq W8A8", acc_q, q1, q256, qf.report().param_bytes),
    ]
    print(f"{'model':<12}{'accuracy':>10}{'batch 1 ms':>12}{'batch 256 ms':>14}{'param bytes':>13}")
    for name, acc, l1, l256, nbytes in rows:
        print(f"{name:<12}{acc:>10.4f}{l1:>12.3f}{l256:>14.3f}{nbytes:>13,}")
    drop = 100 * (acc_f - acc_q)
    print(
        f"\naccuracy drop {drop:+.2f} points; int8 params are {100 * rows[1][4] / rows[0][4]:.1f}% "
        f"of float; batch-256 speed-up {rows[0][3] / rows[1][3]:.2f}x, batch-1 "
        f"{rows[0][2] / rows[1][2]:.2f}x"
    )
    report = qf.report(sample=(data.x_test[:128],))
    print("\nper-layer report (SQNR of each layer's output vs float on 128 test images):")
    print(report)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.to_json(out / "report.json")
    try:
        print(f"\nSQNR chart: {report.save_plot(out / 'sqnr.png')}")
    except ImportError as e:
        print(f"\n(no chart: {e})")
    path = qf.save(out / f"digits_{args.model}_int8.jaxq")
    loaded = jaxq.load(path)
    b128 = data.x_test[:128]
    same = np.array_equal(np.asarray(loaded(b128)), np.asarray(jax.jit(qf)(b128)))
    float_file = jaxq.trace(f, b128).save(out / f"digits_{args.model}_float.jaxq")
    ratio = path.stat().st_size / float_file.stat().st_size
    print(
        f"saved {path} ({path.stat().st_size:,} bytes, {100 * ratio:.1f}% of the float file); "
        f"loaded without the model code, same outputs: {same}"
    )


if __name__ == "__main__":
    main()
