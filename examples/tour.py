"""A tour of jaxq's foundation on real data: trace a CNN, run passes, read names and layouts.

Trains a small CNN on scikit-learn's digits (shipped with the package, no download) for a few
seconds, traces it into a jaxq Program, runs a pipeline of passes under instruments (timing, a
numeric check on real images, well-formedness), and shows the result is an ordinary JAX function.

Run: python examples/tour.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from sklearn.datasets import load_digits

import jaxq
from jaxq import transform as T


def init(key: jax.Array) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "conv0": (jax.random.normal(k1, (3, 3, 1, 8)) * 0.3, jnp.zeros(8)),
        "conv1": (jax.random.normal(k2, (3, 3, 8, 16)) * 0.1, jnp.zeros(16)),
        "dense": (jax.random.normal(k3, (16 * 4 * 4, 10)) * 0.05, jnp.zeros(10)),
    }


def cnn(params: dict, x: jax.Array) -> jax.Array:
    """NHWC images (N, 8, 8, 1) -> logits (N, 10). Named scopes play the role of Flax modules."""
    with jax.named_scope("CNN"):
        for i in range(2):
            k, b = params[f"conv{i}"]
            with jax.named_scope(f"Conv_{i}"):
                x = lax.conv_general_dilated(
                    x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
                x = jax.nn.relu(x + b)
        x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        w, b = params["dense"]
        with jax.named_scope("Dense_0"):
            return x.reshape(x.shape[0], -1) @ w + b


def train(x: np.ndarray, y: np.ndarray, steps: int = 300) -> dict:
    params = init(jax.random.key(0))

    def loss(p, xb, yb):
        logp = jax.nn.log_softmax(cnn(p, xb))
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=1))

    @jax.jit
    def step(p, xb, yb):
        g = jax.grad(loss)(p, xb, yb)
        return jax.tree.map(lambda a, d: a - 0.1 * d, p, g)

    rng = np.random.default_rng(0)
    for _ in range(steps):
        idx = rng.integers(0, len(x), 128)
        params = step(params, x[idx], y[idx])
    return params


def main() -> None:
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]

    t0 = time.perf_counter()
    params = train(x_train, y_train)
    acc = float(np.mean(np.argmax(jax.jit(cnn)(params, x_test), -1) == y_test))
    print(f"trained CNN in {time.perf_counter() - t0:.1f}s; float test accuracy {acc:.4f}")

    program = jaxq.trace(cnn, params, x_test[:64])
    print(f"\ntraced: {program!r}")

    pipeline = T.Sequential([T.identity(), T.name_expressions(), T.infer_layouts()], name="tour")
    timing = T.PassTiming()
    checks = [T.NumericCheck(params, x_test[:64], rtol=0, atol=0), T.WellFormed()]
    with T.PassContext(instruments=[timing, *checks]):
        program = pipeline(program)
    print("\npasses (numerics checked bit-exact on 64 real test images after each):")
    print(timing)

    print("\nequations with layouts (first 12):")
    for e in list(program.equations())[:12]:
        print(f"  {e.name:<38} {e.primitive:<22} in={e.in_layouts} out={e.out_layouts}")

    fun = program.as_fun()
    logits = jax.jit(fun)(params, x_test[:64])
    same = np.array_equal(np.asarray(logits), np.asarray(jax.jit(cnn)(params, x_test[:64])))
    print(f"\njit(program.as_fun()) equals jit(cnn) bit for bit: {same}")
    single = jaxq.trace(cnn, params, x_test[:1]).as_fun()  # a Program is specialised to its shapes
    per_example = jax.vmap(single, in_axes=(None, 0))(params, x_test[:64, None])
    print(f"vmap of a batch-1 program over 64 images: output {per_example.shape}")
    hlo = jax.jit(fun).lower(params, x_test[:64]).as_text(debug_info=True)
    print(f"stable names in XLA metadata: {'CNN/Conv_1/conv_general_dilated' in hlo}")
    print("\nIR (first 14 lines):")
    print("\n".join(str(program).splitlines()[:14]))


if __name__ == "__main__":
    main()
