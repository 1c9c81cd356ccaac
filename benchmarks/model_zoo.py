"""Real architectures from the JAX ecosystem, each as ``(function, example_args)``.

Flax linen and nnx, Equinox, dm-haiku's ResNet50 and MobileNetV1 (random init), and models with
scan / cond / while inside. Each builder imports its library lazily, so a missing one is reported
as skipped rather than failing the sweep.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Model = tuple[Callable[..., Any], tuple[Any, ...]]


def _inputs(*shape: int) -> np.ndarray:
    """Random inputs: constant ones make LayerNorm outputs zero and hide quantization error."""
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def flax_linen_cnn() -> Model:
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(16, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), (2, 2))
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = x.reshape(x.shape[0], -1)
            x = nn.relu(nn.Dense(64)(x))
            return nn.Dense(10)(x)

    x = _inputs(4, 16, 16, 3)
    model = CNN()
    params = model.init(jax.random.key(0), x)
    return functools.partial(model.apply, params), (x,)


def flax_linen_transformer() -> Model:
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.LayerNorm()(x)
            y = nn.MultiHeadDotProductAttention(num_heads=4)(y, y)
            x = x + y
            y = nn.Dense(128)(nn.LayerNorm()(x))
            return x + nn.Dense(64)(nn.gelu(y))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = Block()(x)
            return x

    x = _inputs(2, 8, 64)
    model = Model()
    params = model.init(jax.random.key(0), x)
    return functools.partial(model.apply, params), (x,)


def flax_nnx_mlp() -> Model:
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(32, 64, rngs=rngs)
            self.l2 = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    model = MLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def f(x):
        return nnx.merge(graphdef, state)(x)

    return f, (_inputs(8, 32),)


def equinox_mlp() -> Model:
    import equinox as eqx

    model = eqx.nn.MLP(32, 10, 64, depth=3, key=jax.random.key(0))
    return jax.vmap(model), (_inputs(8, 32),)


def equinox_cnn() -> Model:
    import equinox as eqx

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    conv1 = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1)
    conv2 = eqx.nn.Conv2d(8, 8, 3, padding=1, key=k2)
    lin = eqx.nn.Linear(8 * 8 * 8, 10, key=k3)

    def f(x):  # CHW images, vmapped over the batch
        def one(img):
            h = jax.nn.relu(conv1(img))
            h = jax.nn.relu(conv2(h))
            return lin(h.reshape(-1))

        return jax.vmap(one)(x)

    return f, (_inputs(2, 3, 8, 8),)


def _haiku(net: str) -> Model:
    import haiku as hk

    def forward(x, training):
        if net == "resnet50":  # haiku zero-initialises the logits; random ones show real error
            logits = {"w_init": hk.initializers.TruncatedNormal(0.01), "name": "logits"}
            return hk.nets.ResNet50(1000, logits_config=logits)(x, is_training=training)
        return hk.nets.MobileNetV1(num_classes=1000)(x, is_training=training)

    model = hk.transform_with_state(forward)
    x = _inputs(1, 64, 64, 3)
    params, state = model.init(jax.random.key(0), x, True)  # creates the batch-norm statistics

    def f(x):
        return model.apply(params, state, None, x, False)[0]

    return f, (x,)


def haiku_resnet50() -> Model:
    return _haiku("resnet50")


def haiku_mobilenet_v1() -> Model:
    return _haiku("mobilenet")


def control_flow_rnn() -> Model:
    """An RNN over time with scan, a cond on the input norm and a while-loop refinement."""
    rng = np.random.default_rng(0)
    wx = rng.standard_normal((16, 32)).astype(np.float32) * 0.2
    wh = rng.standard_normal((32, 32)).astype(np.float32) * 0.2
    wo = rng.standard_normal((32, 10)).astype(np.float32) * 0.2

    def f(xs):
        def cell(h, x):
            h = jnp.tanh(x @ wx + h @ wh)
            return h, h

        h, _ = jax.lax.scan(cell, jnp.zeros((xs.shape[1], 32), np.float32), xs)
        h = jax.lax.cond(jnp.linalg.norm(h) > 1.0, lambda v: v / 2, lambda v: v, h)
        h = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.9 + 0.01), (0, h))[
            1
        ]
        return h @ wo

    return f, (_inputs(5, 4, 16),)


MODELS: dict[str, Callable[[], Model]] = {
    "flax.linen CNN": flax_linen_cnn,
    "flax.linen transformer": flax_linen_transformer,
    "flax.nnx MLP": flax_nnx_mlp,
    "equinox MLP": equinox_mlp,
    "equinox CNN": equinox_cnn,
    "haiku ResNet50": haiku_resnet50,
    "haiku MobileNetV1": haiku_mobilenet_v1,
    "scan/cond/while RNN": control_flow_rnn,
}
