"""The main job: train a CNN on scikit-learn's digits, quantize it to int8 with jaxq, compare.

1. trains a small CNN on the digits (shipped inside scikit-learn, no download) in seconds;
2. quantizes it with ``jaxq.quantize(apply, params, ...)`` (W8A8 static: int8 per-channel weights,
   int8 activations
   calibrated on training images), which runs real int8 x int8 -> int32 XLA dots and convolutions;
3. prints float vs int8 test accuracy, jitted CPU latency at batch 1 and 256 (each variant timed
   round by round with float; paired speed-ups), parameter bytes, and the per-layer report with
   each layer's SQNR, worst first; with ``jaxq[onnx]``, also the int8 function offloaded to ONNX
   Runtime (``jaxq.offload``) beside the XLA one;
4. saves the int8 model to one file and runs it back without the model code.

Run: python examples/quantize_digits.py [--steps 600] [--model cnn|mlp] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import numpy as np

import jaxq

sys.path.insert(0, str(Path(__file__).parent))
import digits  # noqa: E402


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
    # the same int8 function with its integer code in ONNX Runtime's kernels (jaxq[onnx])
    variants = {"float32": f_jit, "jaxq W8A8": q_jit}
    try:
        variants["jaxq W8A8 -> ORT"] = jax.jit(jaxq.offload(qf, "onnxruntime"))
    except ImportError as e:
        print(f"(no ONNX Runtime variant: {e})")
    accuracy = {k: digits.accuracy(fn, data.x_test, data.y_test) for k, fn in variants.items()}
    acc_f, acc_q = accuracy["float32"], accuracy["jaxq W8A8"]
    # each variant called round by round with float on the same inputs: paired speed-ups survive
    # a re-run. ONNX Runtime in a run of its own: its threads waking between XLA's calls slowed
    # them (the XLA W8A8 at batch 1 ran 1.02x float alone, 0.89-0.95x beside ONNX Runtime)
    b1, b256 = data.x_test[:1], np.concatenate([data.x_test] * 2)[:256]
    groups = [{k: v for k, v in variants.items() if not k.endswith("ORT")}]
    groups += [{"float32": f_jit, k: v} for k, v in variants.items() if k.endswith("ORT")]
    t1: dict[str, jaxq.Timing] = {}
    t256: dict[str, jaxq.Timing] = {}
    rows = list(variants)  # (and the float time of each run of its own, above its variant)
    for group in groups:
        base = "float32" if "float32" not in t1 else f"  float32, {list(group)[1]}'s run"
        for t, x, rounds in ((t1, b1, 400), (t256, b256, 60)):
            table = jaxq.compare_timing(group, x, rounds=rounds)
            t.update({k: table[k] for k in group if k != "float32"} | {base: table["float32"]})
        if base != "float32":
            rows.insert(rows.index(list(group)[1]), base)
    nbytes = {"float32": sum(np.asarray(p).nbytes for p in jax.tree.leaves(params))}
    nbytes |= {k: qf.report().param_bytes for k in variants if k != "float32"}
    print(
        f"{'model':<18}{'accuracy':>10}{'param bytes':>13}{'batch 1 ms':>12}{'speed-up':>10}"
        f"{'batch 256 ms':>14}{'speed-up':>10}"
    )
    for name in rows:
        r1, r256 = t1[name], t256[name]
        first = (
            f"{name:<18}{accuracy[name]:>10.4f}{nbytes[name]:>13,}"
            if name in variants
            else f"{name:<41}"
        )
        print(f"{first}{r1.ms:>12.3f}{r1.speedup:>9.2f}x{r256.ms:>14.3f}{r256.speedup:>9.2f}x")
    drop = 100 * (acc_f - acc_q)
    (lo1, hi1), (lo256, hi256) = t1["jaxq W8A8"].interval, t256["jaxq W8A8"].interval
    print(
        f"\naccuracy drop {drop:+.2f} points; int8 params are "
        f"{100 * nbytes['jaxq W8A8'] / nbytes['float32']:.1f}% "
        f"of float; speed-up (median of per-round float/int8 times, 95% interval): batch 256 "
        f"{t256['jaxq W8A8'].speedup:.2f}x ({lo256:.2f}-{hi256:.2f}), batch 1 "
        f"{t1['jaxq W8A8'].speedup:.2f}x ({lo1:.2f}-{hi1:.2f}) on jax {jax.__version__}"
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
