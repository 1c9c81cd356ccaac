"""scikit-learn's digits (ships offline) and two small models trained on it in seconds.

Shared by the examples and the benchmarks, so every comparison uses the same data, the same models
and the same trained weights. Named scopes play the role of Flax module paths, so jaxq's equation
names read ``CNN/Conv_0/conv_general_dilated``, ``MLP/Dense_1/dot_general``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Data:
    x_train: np.ndarray  # (N, 8, 8, 1) float32 in [0, 1]
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load(split: int = 1400) -> Data:
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))  # fixed, writer-mixed split
    x = (digits.images[order] / 16.0).astype(np.float32)[..., None]
    y = digits.target[order].astype(np.int32)
    return Data(x[:split], y[:split], x[split:], y[split:])


def init_cnn(key: jax.Array) -> Params:
    k1, k2, k3, k4 = jax.random.split(key, 4)
    he = lambda k, shape, fan_in: jax.random.normal(k, shape) * np.sqrt(2.0 / fan_in)
    return {
        "conv0": {"w": he(k1, (3, 3, 1, 16), 9), "b": jnp.zeros(16)},
        "conv1": {"w": he(k2, (3, 3, 16, 32), 144), "b": jnp.zeros(32)},
        "dense0": {"w": he(k3, (4 * 4 * 32, 64), 512), "b": jnp.zeros(64)},
        "dense1": {"w": he(k4, (64, 10), 64), "b": jnp.zeros(10)},
    }


def cnn(params: Params, x: jax.Array) -> jax.Array:
    """NHWC images (N, 8, 8, 1) -> logits (N, 10)."""
    with jax.named_scope("CNN"):
        for i in range(2):
            p = params[f"conv{i}"]
            with jax.named_scope(f"Conv_{i}"):
                x = lax.conv_general_dilated(
                    x, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
                x = jax.nn.relu(x + p["b"])
        x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        x = x.reshape(x.shape[0], -1)
        with jax.named_scope("Dense_0"):
            x = jax.nn.relu(x @ params["dense0"]["w"] + params["dense0"]["b"])
        with jax.named_scope("Dense_1"):
            return x @ params["dense1"]["w"] + params["dense1"]["b"]


def init_mlp(key: jax.Array, hidden: int = 256) -> Params:
    k1, k2, k3 = jax.random.split(key, 3)
    he = lambda k, shape: jax.random.normal(k, shape) * np.sqrt(2.0 / shape[0])
    return {
        "dense0": {"w": he(k1, (64, hidden)), "b": jnp.zeros(hidden)},
        "dense1": {"w": he(k2, (hidden, hidden)), "b": jnp.zeros(hidden)},
        "dense2": {"w": he(k3, (hidden, 10)), "b": jnp.zeros(10)},
    }


def mlp(params: Params, x: jax.Array) -> jax.Array:
    """Images (N, 8, 8, 1) -> logits (N, 10)."""
    with jax.named_scope("MLP"):
        x = x.reshape(x.shape[0], -1)
        for i in range(3):
            p = params[f"dense{i}"]
            with jax.named_scope(f"Dense_{i}"):
                x = x @ p["w"] + p["b"]
                if i < 2:
                    x = jax.nn.relu(x)
        return x


MODELS: dict[str, tuple[Callable[[jax.Array], Params], Callable[..., jax.Array]]] = {
    "cnn": (init_cnn, cnn),
    "mlp": (init_mlp, mlp),
}


def train(
    model: str, data: Data, steps: int = 600, batch: int = 128, lr: float = 0.05, seed: int = 0
) -> Params:
    """Adam-free SGD with momentum; deterministic for a given seed."""
    init, apply = MODELS[model]
    params = init(jax.random.key(seed))
    velocity = jax.tree.map(jnp.zeros_like, params)

    def loss(p: Params, xb: jax.Array, yb: jax.Array) -> jax.Array:
        logp = jax.nn.log_softmax(apply(p, xb))
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=1))

    @jax.jit
    def step(p: Params, v: Params, xb: jax.Array, yb: jax.Array) -> tuple[Params, Params]:
        g = jax.grad(loss)(p, xb, yb)
        v = jax.tree.map(lambda a, d: 0.9 * a + d, v, g)
        return jax.tree.map(lambda a, d: a - lr * d, p, v), v

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(data.x_train), batch)
        params, velocity = step(params, velocity, data.x_train[idx], data.y_train[idx])
    return jax.tree.map(np.asarray, params)


def accuracy(f: Callable[[jax.Array], jax.Array], x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(np.asarray(f(x)), -1) == y))
