"""Exact integer sums of int8 products, on the route the platform has.

XLA:CPU has int8 x int8 -> int32 dots and convolutions. XLA:GPU (seen with jax 0.11.2 on an H100
and an H200) has no int8 convolution (it widens the operands to s32, which cuDNN does not
convolve), and its int8 dots gave wrong sums for some shapes (a contraction of 3 run by cuBLAS;
an 18 x 16 x 8 dot fused into a Triton GEMM). There the sums are carried in float32 instead:
int8 codes and their products are exact in f32 (and in TF32, which holds 11-bit integers), and so
is every partial sum below 2**24, so the contracted axis is cut into chunks whose sums stay below
it, each rounded and added in int32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxq.quantize._tuning import current_tuning

F32_EXACT = 2**24
"""Integers below this are exact in float32."""

_INT8_PRODUCT = 128 * 128
"""The largest magnitude of a product of two int8 codes."""


def sums_in_chunks(part: Callable[[int, int], jax.Array], size: int, per_index: int) -> jax.Array:
    """The int32 sum over ``[0, size)`` of the f32 sums ``part(lo, hi)`` of slices of a
    contracted axis, each slice short enough that its sums, at most ``per_index`` for each index
    of the axis, stay below 2**24; each is rounded (a float algorithm off by less than 0.5 still
    gives the integer) before it is added in int32."""
    assert per_index < F32_EXACT  # callers raise a QuantizeError naming the layer
    step = max(1, (F32_EXACT - 1) // per_index)
    acc = None
    for lo in range(0, size, step):
        s = jnp.round(part(lo, min(lo + step, size))).astype(jnp.int32)
        acc = s if acc is None else acc + s
    assert acc is not None  # a contracted axis has at least one index
    return acc


def int_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any) -> jax.Array:
    """``lax.dot_general`` of int8 codes to their exact int32 sums: XLA's int8 kernel where the
    tuning says the platform's is sound (``Tuning.s8_dot``), else f32 dots of chunks of the
    contracted axes (merged into one axis first where there are several)."""
    dn = dimension_numbers
    if current_tuning().s8_dot:
        return lax.dot_general(lhs, rhs, dn, preferred_element_type=jnp.int32)
    (lc, rc), (lb, rb) = dn
    lf, rf = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    if not lc:  # (an outer product: one product per output)
        return lax.dot_general(lf, rf, dn, preferred_element_type=jnp.float32).astype(jnp.int32)
    if len(lc) > 1:  # contracted axes last, as one (the output's layout does not depend on it)
        lf, lb = _merge_last(lf, lc, lb)
        rf, rb = _merge_last(rf, rc, rb)
        lc, rc = (lf.ndim - 1,), (rf.ndim - 1,)
        dn = ((lc, rc), (lb, rb))
    return sums_in_chunks(
        lambda lo, hi: lax.dot_general(
            lax.slice_in_dim(lf, lo, hi, axis=lc[0]),
            lax.slice_in_dim(rf, lo, hi, axis=rc[0]),
            dn,
            preferred_element_type=jnp.float32,
        ),
        lf.shape[lc[0]],
        _INT8_PRODUCT,
    )


def _merge_last(x: jax.Array, axes: Any, batch: Any) -> tuple[jax.Array, tuple[int, ...]]:
    """``x`` with ``axes`` (in that order) moved last and merged into one; the new positions of
    the ``batch`` axes."""
    rest = [d for d in range(x.ndim) if d not in axes]
    x = jnp.transpose(x, (*rest, *axes))
    return x.reshape(*x.shape[: len(rest)], -1), tuple(rest.index(d) for d in batch)
