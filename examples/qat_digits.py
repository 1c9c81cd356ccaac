"""Quantization-aware training: a low-bit digits CNN that post-training quantization breaks.

1. trains the digits CNN of ``examples/quantize_digits.py`` in float;
2. post-training quantization (PTQ) to 2-bit (ternary) weights and 4-bit activations in the hidden
   layers (8-bit weights in the first convolution and the classifier) loses most of it;
3. QAT: ``qs = jaxq.quantize(cnn, params, ..., mode="simulate")`` fake-quantizes the float params it
   is given, and ``jax.grad`` of a loss through ``qs.apply`` trains them (straight-through
   gradients; the weight scales follow the weights);
4. ``qs.realize(trained)`` is the integer model, evaluated as it runs (packed codes, integer dots),
   with the activation scales QAT trained against: its accuracy is the simulated one.

Prints float / PTQ / QAT accuracy and the realized bytes; exits with status 1 if QAT does not
come within 1 point of float.

Run: python examples/qat_digits.py [--steps 1000] [--wbits 2] [--abits 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxq

sys.path.insert(0, str(Path(__file__).parent))
import digits  # noqa: E402


def low_bit_config(wbits: int, abits: int) -> jaxq.QConfig:
    """``wbits``-bit per-channel weights and ``abits``-bit activations (calibrated per tensor)
    in the hidden layers; the first convolution (one input channel) and the classifier keep
    8-bit weights, as low-bit deployments usually do (TVM skips the first convolution)."""
    return jaxq.QConfig(
        weights=jaxq.Scheme(bits=wbits, granularity="channel", narrow_range=True),
        activations=jaxq.Scheme(bits=abits, symmetric=False),
        rules=(jaxq.Rule(pattern="Conv_0|Dense_1", weights=jaxq.Scheme(bits=8)),),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wbits", type=int, default=2, help="weight bits (2: ternary codes)")
    ap.add_argument("--abits", type=int, default=4, help="activation bits")
    ap.add_argument("--steps", type=int, default=1000, help="QAT steps")
    ap.add_argument(
        "--lr", type=float, default=2e-3, help="peak Adam learning rate for QAT (cosine decay)"
    )
    args = ap.parse_args(argv)

    data = digits.load()
    t0 = time.perf_counter()
    params = digits.train("cnn", data, steps=600)
    cnn = digits.cnn
    acc = lambda f: digits.accuracy(jax.jit(f), data.x_test, data.y_test)
    acc_float = acc(lambda x: cnn(params, x))
    print(f"float CNN trained in {time.perf_counter() - t0:.1f}s: test accuracy {acc_float:.4f}")

    config = low_bit_config(args.wbits, args.abits)
    calibration = [(data.x_train[i : i + 128],) for i in range(0, 512, 128)]
    ptq = jaxq.quantize(cnn, params, calibration=calibration, config=config, progress=False)
    acc_ptq = acc(ptq)

    # QAT: start from the float params; Adam on the simulated (fake-quantized) model
    qs = jaxq.quantize(
        cnn, params, calibration=calibration, config=config, mode="simulate", progress=False
    )

    def loss(p: dict, xb: jax.Array, yb: jax.Array) -> jax.Array:
        logp = jax.nn.log_softmax(qs.apply(p, xb))
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=1))

    @jax.jit
    def step(p: dict, m: dict, v: dict, t: jax.Array, xb: jax.Array, yb: jax.Array) -> tuple:
        g = jax.grad(loss)(p, xb, yb)
        m = jax.tree.map(lambda a, d: 0.9 * a + 0.1 * d, m, g)
        v = jax.tree.map(lambda a, d: 0.999 * a + 0.001 * d * d, v, g)
        mh, vh = 1 - 0.9**t, 1 - 0.999**t
        lr = args.lr * 0.5 * (1 + jnp.cos(jnp.pi * t / args.steps))  # (cosine decay: settles)
        p = jax.tree.map(lambda w, a, b: w - lr * (a / mh) / (jnp.sqrt(b / vh) + 1e-8), p, m, v)
        return p, m, v

    t0 = time.perf_counter()
    trained = jax.tree.map(jnp.asarray, params)
    m = jax.tree.map(jnp.zeros_like, trained)
    v = jax.tree.map(jnp.zeros_like, trained)
    rng = np.random.default_rng(1)
    for t in range(1, args.steps + 1):
        idx = rng.integers(0, len(data.x_train), 128)
        trained, m, v = step(trained, m, v, jnp.float32(t), data.x_train[idx], data.y_train[idx])
    qat_s = time.perf_counter() - t0
    acc_sim = acc(lambda x: qs.apply(trained, x))
    # the integer model: the trained weights, with the activation scales QAT trained against
    qat = qs.realize(trained)
    acc_qat = acc(qat)

    float_bytes = sum(np.asarray(p).nbytes for p in jax.tree.leaves(params))
    rows = [
        ("float32", acc_float, float_bytes),
        (f"PTQ W{args.wbits}A{args.abits}", acc_ptq, ptq.report().param_bytes),
        (f"QAT W{args.wbits}A{args.abits} (realized)", acc_qat, qat.report().param_bytes),
    ]
    print(f"\nQAT: {args.steps} Adam steps in {qat_s:.1f}s (simulated accuracy {acc_sim:.4f})")
    print(f"\n{'model':<26}{'accuracy':>10}{'vs float':>10}{'param bytes':>13}{'% float':>9}")
    for name, a, nbytes in rows:
        print(
            f"{name:<26}{a:>10.4f}{100 * (a - acc_float):>+9.2f}p{nbytes:>13,}"
            f"{100 * nbytes / float_bytes:>8.1f}%"
        )
    print(f"config: {config}")
    ok = acc_float - acc_qat <= 0.01
    print(
        f"\nPTQ loses {100 * (acc_float - acc_ptq):.2f} points; QAT is "
        f"{100 * (acc_float - acc_qat):.2f} points from float: "
        + ("within 1 point" if ok else "NOT within 1 point")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
