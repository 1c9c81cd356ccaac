"""Shared hypothesis strategies: shapes, arrays and whole random programs.

``programs()`` draws a random DAG over a pool of float32 matrices: elementwise ops, dot_general,
conv_general_dilated, reshape, transpose, reductions, and nested jit / scan / cond / while / remat /
custom_jvp regions. Weights are closed-over constants, so the traced jaxpr has constvars too.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

EXAMPLES = float(os.environ.get("JAXQ_TEST_EXAMPLES", "1"))
"""A factor on every property's number of examples: CI's second stack runs them with fewer
(``JAXQ_TEST_EXAMPLES=0.25``), the first with all."""


def examples(n: int) -> int:
    """``n`` examples, scaled by ``JAXQ_TEST_EXAMPLES`` (at least 2)."""
    return max(2, round(n * EXAMPLES))


OPS = (
    "unary",
    "binary",
    "dot",
    "conv",
    "transpose",
    "reshape",
    "center",
    "jit",
    "scan",
    "cond",
    "while",
    "remat",
    "relu",
)


@dataclasses.dataclass(frozen=True)
class RandomProgram:
    fun: Callable[..., Any]
    args: tuple[np.ndarray, ...]
    ops: tuple[str, ...]

    def __repr__(self) -> str:
        shapes = [a.shape for a in self.args]
        return f"RandomProgram(ops={self.ops}, arg shapes={shapes})"


def _unary(kind: int, x: jax.Array) -> jax.Array:
    return (jnp.sin, jnp.tanh, jnp.abs, jnp.negative, lambda v: v * 0.5)[kind](x)


def _binary(kind: int, x: jax.Array, y: jax.Array) -> jax.Array:
    return (jnp.add, jnp.subtract, jnp.multiply, jnp.maximum, jnp.minimum)[kind](x, y)


@st.composite
def programs(draw: st.DrawFn, max_ops: int = 8, ops: tuple[str, ...] = OPS) -> RandomProgram:
    n = draw(st.integers(2, 5))
    m = draw(st.integers(2, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    num_args = draw(st.integers(1, 3))
    args = tuple(rng.standard_normal((n, m)).astype(np.float32) for _ in range(num_args))
    steps = []
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(ops))
        a, b, kind = draw(st.integers(0, 99)), draw(st.integers(0, 99)), draw(st.integers(0, 4))
        steps.append((op, a, b, kind))
    weights = [rng.standard_normal((m, m)).astype(np.float32) * 0.5 for _ in steps]
    kernels = [rng.standard_normal((3, 3, 1, 1)).astype(np.float32) * 0.3 for _ in steps]
    num_outputs = draw(st.integers(1, 2))

    def fun(*xs: jax.Array) -> Any:
        pool = list(xs)
        for i, (op, a, b, kind) in enumerate(steps):
            x = pool[a % len(pool)]
            same = [v for v in pool if v.shape == x.shape]
            y = same[b % len(same)]
            pool.append(_step(op, kind, x, y, weights[i], kernels[i]))
        outs = [pool[-1 - k] for k in range(min(num_outputs, len(pool)))]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return RandomProgram(fun, args, tuple(s[0] for s in steps))


def _step(
    op: str, kind: int, x: jax.Array, y: jax.Array, w: np.ndarray, k: np.ndarray
) -> jax.Array:
    if op == "unary":
        return _unary(kind, x)
    if op == "binary":
        return _binary(kind, x, y)
    if op == "dot":
        w = w if x.shape[1] == w.shape[0] else np.ones((x.shape[1], x.shape[1]), np.float32) * 0.1
        return lax.dot_general(x, w, (((1,), (0,)), ((), ())))
    if op == "conv":
        img = x.reshape(1, *x.shape, 1)
        out = lax.conv_general_dilated(
            img, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return out.reshape(x.shape)
    if op == "transpose":
        return x.T
    if op == "reshape":
        return x.reshape(x.shape[1], x.shape[0])
    if op == "center":
        return x - jnp.mean(x, axis=1, keepdims=True) + jnp.max(x, axis=0)
    if op == "jit":
        return jax.jit(lambda u, v: jnp.sin(u) * v + 1.0)(x, y)
    if op == "scan":

        def body(c, r):
            return c * 0.5 + r, jnp.tanh(c + r)

        _, ys = lax.scan(body, jnp.zeros(x.shape[1:], x.dtype), x)
        return ys
    if op == "cond":
        return lax.cond(jnp.sum(x) > 0, lambda u: u * 2.0, lambda u: jnp.cos(u), x)
    if op == "while":
        return lax.fori_loop(0, 3, lambda _, u: u * 0.9 + 0.1, x)
    if op == "remat":
        return jax.checkpoint(lambda u: jnp.sin(u) * u)(x)
    if op == "relu":  # jax.nn.relu is a custom_jvp function
        return jax.nn.relu(x) + jax.nn.gelu(y)
    raise AssertionError(op)


def arrays(shape: tuple[int, ...], dtype: Any = np.float32) -> st.SearchStrategy[np.ndarray]:
    """Finite arrays of a given shape from a seeded generator (fast, shrinks by seed)."""
    return st.integers(0, 2**16).map(
        lambda seed: np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    )
