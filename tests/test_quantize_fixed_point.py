"""Integer-only requantization against the numpy (Python int) reference of gemmlowp / TFLite."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxq.quantize import _fixed_point as F

I32 = st.integers(-(2**31), 2**31 - 1)
EDGES = [
    -(2**31),
    -(2**31) + 1,
    -(2**30),
    -65536,
    -65535,
    -32768,
    -2,
    -1,
    0,
    1,
    2,
    32767,
    65535,
    65536,
    2**30,
    2**31 - 2,
    2**31 - 1,
]

srdhm = jax.jit(F.srdhm)
rdbp = jax.jit(F.rounding_divide_by_pot)
requant = jax.jit(F.requantize, static_argnames=("qmin", "qmax"))


def test_srdhm_edge_grid():
    a, b = np.meshgrid(np.array(EDGES, np.int64), np.array(EDGES, np.int64))
    a, b = a.ravel(), b.ravel()
    got = np.asarray(srdhm(a.astype(np.int32), b.astype(np.int32)))
    want = np.array([F.ref_srdhm(int(x), int(y)) for x, y in zip(a, b, strict=True)])
    np.testing.assert_array_equal(got, want)
    assert F.ref_srdhm(-(2**31), -(2**31)) == 2**31 - 1  # the one saturating case


@given(st.lists(st.tuples(I32, I32), min_size=1, max_size=64))
def test_srdhm_random(pairs):
    a = np.array([p[0] for p in pairs], np.int64)
    b = np.array([p[1] for p in pairs], np.int64)
    got = np.asarray(srdhm(a.astype(np.int32), b.astype(np.int32)))
    want = np.array([F.ref_srdhm(int(x), int(y)) for x, y in pairs])
    np.testing.assert_array_equal(got, want)


def test_rounding_divide_by_pot_ties_away_from_zero():
    x = np.array([5, -5, 6, -6, 7, -7, 2**31 - 1, -(2**31)], np.int32)
    for e in (0, 1, 2, 5, 30, 31):
        got = np.asarray(rdbp(x, np.int32(e)))
        want = [F.ref_rounding_divide_by_pot(int(v), e) for v in x]
        np.testing.assert_array_equal(got, want)
    assert F.ref_rounding_divide_by_pot(5, 1) == 3 and F.ref_rounding_divide_by_pot(-5, 1) == -3


def test_quantize_multiplier():
    assert F.quantize_multiplier(0.5) == (2**30, 0)
    assert F.quantize_multiplier(1.0) == (2**30, 1)
    assert F.quantize_multiplier(0.0) == (0, 0)
    assert F.quantize_multiplier(2.0**-40) == (0, 0)  # below a 31-bit shift
    m, e = F.quantize_multiplier(1 - 2**-40)  # rounds up to 2**31: halved, exponent bumped
    assert (m, e) == (2**30, 1)
    with pytest.raises(ValueError, match="too large"):
        F.quantize_multiplier(2.0**40)
    with pytest.raises(ValueError, match="finite"):
        F.quantize_multiplier(math.nan)


@given(st.floats(1e-6, 8.0), st.lists(I32.map(lambda v: v >> 8), min_size=1, max_size=32))
def test_requantize_matches_reference(multiplier, accs):
    m, e = F.quantize_multiplier(multiplier)
    assert 2**30 <= m < 2**31
    assert abs(m * 2.0 ** (e - 31) - multiplier) <= multiplier * 2**-30
    acc = np.array(accs, np.int32)
    if e > 0:  # keep the left shift in range, as realize does
        acc = np.clip(acc, -(2 ** (31 - e)), 2 ** (31 - e) - 1).astype(np.int32)
    got = np.asarray(requant(acc, np.int32(m), np.int32(e), np.int32(3), qmin=-128, qmax=127))
    want = F.ref_requantize(acc, m, e, 3, -128, 127)
    np.testing.assert_array_equal(got, want)


def test_requantize_per_channel_and_close_to_float():
    rng = np.random.default_rng(0)
    acc = rng.integers(-(2**20), 2**20, size=(16, 4)).astype(np.int32)
    mult = np.array([0.0004, 0.013, 0.25, 0.9])
    m, e = F.quantize_multipliers(mult)
    got = np.asarray(requant(acc, m, e, np.int32(0), qmin=-(2**31) + 1, qmax=2**31 - 1))
    np.testing.assert_array_equal(got, F.ref_requantize(acc, m, e, 0, -(2**31) + 1, 2**31 - 1))
    assert np.all(np.abs(got - acc * mult) <= 0.5 + 1e-6 * np.abs(acc * mult) + 1)


def test_int32_only():
    jaxpr = jax.make_jaxpr(F.requantize, static_argnums=(4, 5))(
        jnp.zeros(4, jnp.int32), jnp.int32(1), jnp.int32(-3), jnp.int32(0), -128, 127
    )
    dtypes = {str(v.aval.dtype) for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars}
    assert dtypes <= {"int32", "uint32", "bool"}, dtypes
