"""Integer-only requantization (gemmlowp / TFLite): a fixed-point multiplier and a rounding shift.

``M = s_in / s_out`` is written ``m * 2**e`` with ``m`` an int32 in ``[2**30, 2**31)`` (Q31 of a
fraction in [0.5, 1)). ``requantize(acc) = RoundingDivideByPOT(SRDHM(acc << max(e, 0), m),
max(-e, 0))``. Two versions live here: a numpy reference with Python-int arithmetic, and a jnp
version that only uses int32/uint32 (no int64: JAX has it off by default), exact against it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def quantize_multiplier(multiplier: float) -> tuple[int, int]:
    """``(m, e)`` with ``multiplier ~= m * 2**(e - 31)``, ``m`` in ``[2**30, 2**31)`` (0 for 0)."""
    if not math.isfinite(multiplier) or multiplier < 0:
        raise ValueError(
            f"quantize_multiplier: multiplier must be finite and >= 0; got {multiplier}"
        )
    if multiplier == 0:
        return 0, 0
    frac, e = math.frexp(multiplier)
    m = math.floor(frac * 2**31 + 0.5)  # TFLite rounds half away from zero; frac > 0
    if m == 2**31:
        m //= 2
        e += 1
    if e < -31:  # below the smallest representable shift: the product rounds to 0
        return 0, 0
    if e > 30:
        raise ValueError(
            f"quantize_multiplier: multiplier {multiplier} is too large for int32 fixed point "
            f"(needs a left shift of {e} bits)"
        )
    return m, e


def quantize_multipliers(multipliers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    pairs = [quantize_multiplier(float(v)) for v in np.ravel(multipliers)]
    shape = np.shape(multipliers)
    m = np.array([p[0] for p in pairs], np.int64).reshape(shape)
    e = np.array([p[1] for p in pairs], np.int64).reshape(shape)
    return m.astype(np.int32), e.astype(np.int32)


# ---- the numpy reference (Python ints: no overflow anywhere) ---------------------------------


def _wrap32(v: int) -> int:
    return (v + 2**31) % 2**32 - 2**31


def ref_srdhm(a: int, b: int) -> int:
    """gemmlowp SaturatingRoundingDoublingHighMul on int32 values."""
    if a == b == INT32_MIN:
        return INT32_MAX
    ab = a * b
    nudge = (1 << 30) if ab >= 0 else (1 - (1 << 30))
    v = ab + nudge
    q = abs(v) >> 31  # C++ integer division truncates towards zero
    return q if v >= 0 else -q


def ref_rounding_divide_by_pot(x: int, exponent: int) -> int:
    """gemmlowp RoundingDivideByPOT: round half away from zero of ``x / 2**exponent``."""
    mask = (1 << exponent) - 1
    remainder = x & mask
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if remainder > threshold else 0)


def ref_multiply_by_quantized_multiplier(x: int, m: int, e: int) -> int:
    left, right = max(e, 0), max(-e, 0)
    return ref_rounding_divide_by_pot(ref_srdhm(_wrap32(x * (1 << left)), m), right)


def ref_requantize(
    acc: np.ndarray, m: np.ndarray, e: np.ndarray, zero_point: np.ndarray, qmin: int, qmax: int
) -> np.ndarray:
    """Reference int32 -> int code requantization, elementwise with broadcasting."""
    acc, m, e, zp = np.broadcast_arrays(
        np.asarray(acc), np.asarray(m), np.asarray(e), np.asarray(zero_point)
    )
    out = np.empty(acc.shape, np.int64)
    for idx in np.ndindex(acc.shape):
        v = ref_multiply_by_quantized_multiplier(int(acc[idx]), int(m[idx]), int(e[idx]))
        out[idx] = min(max(v + int(zp[idx]), qmin), qmax)
    return out


# ---- int32-only jnp implementation ------------------------------------------------------------


def _i32(v: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(v, jnp.int32)


def _u32(v: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(v, jnp.uint32)


def srdhm(a: jax.Array, b: jax.Array) -> jax.Array:
    """SaturatingRoundingDoublingHighMul with int32 / uint32 arithmetic only.

    The 64-bit product is built as (hi: int32, lo: uint32) from 16-bit halves.
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))
    a_hi, b_hi = a >> 16, b >> 16  # signed high halves
    a_lo, b_lo = a & 0xFFFF, b & 0xFFFF  # unsigned low halves (non-negative int32)

    def add64(h1, l1, h2, l2):
        lo = l1 + l2
        return h1 + h2 + (lo < l1).astype(jnp.int32), lo

    hi = a_hi * b_hi  # |.| <= 2**30
    lo = _u32(a_lo) * _u32(b_lo)  # < 2**32: exact as uint32
    for p in (a_hi * b_lo, a_lo * b_hi):  # |p| < 2**31: fits int32; shift it up by 16 bits
        hi, lo = add64(hi, lo, p >> 16, _u32(p << 16))
    negative = hi < 0
    nudge_hi = jnp.where(negative, -1, 0).astype(jnp.int32)
    nudge_lo = jnp.where(negative, jnp.uint32(1 - (1 << 30) + (1 << 32)), jnp.uint32(1 << 30))
    hi, lo = add64(hi, lo, nudge_hi, nudge_lo)
    floor_div = hi * 2 + _i32(lo >> 31)  # floor((ab + nudge) / 2**31)
    inexact = (lo & jnp.uint32(0x7FFFFFFF)) != 0
    result = floor_div + ((hi < 0) & inexact).astype(jnp.int32)  # truncate towards zero
    saturate = (a == INT32_MIN) & (b == INT32_MIN)
    return jnp.where(saturate, jnp.int32(INT32_MAX), result)


def rounding_divide_by_pot(x: jax.Array, exponent: jax.Array) -> jax.Array:
    x = jnp.asarray(x, jnp.int32)
    exponent = jnp.asarray(exponent, jnp.int32)
    mask = (jnp.int32(1) << exponent) - 1  # exponent 31 wraps to INT32_MAX, as wanted
    remainder = x & mask
    threshold = (mask >> 1) + (x < 0).astype(jnp.int32)
    return (x >> exponent) + (remainder > threshold).astype(jnp.int32)


def multiply_by_quantized_multiplier(x: jax.Array, m: jax.Array, e: jax.Array) -> jax.Array:
    e = jnp.asarray(e, jnp.int32)
    left = jnp.maximum(e, 0)
    right = jnp.maximum(-e, 0)
    return rounding_divide_by_pot(srdhm(jnp.asarray(x, jnp.int32) << left, m), right)


def requantize(
    acc: jax.Array, m: jax.Array, e: jax.Array, zero_point: jax.Array | int, qmin: int, qmax: int
) -> jax.Array:
    """int32 accumulator -> int32 codes in ``[qmin, qmax]`` (cast to int8 by the caller)."""
    v = multiply_by_quantized_multiplier(acc, m, e) + jnp.asarray(zero_point, jnp.int32)
    return jnp.clip(v, qmin, qmax)
