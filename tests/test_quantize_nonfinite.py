"""Non-finite values: the same policy in every mode.

NaN and Inf in an activation row make that row's outputs NaN (a convolution's: that sample's),
never a finite number, and never change another row. Calibration refuses them, naming the layer.
"""

from __future__ import annotations

import functools
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax
from strategies import examples

from jaxq import quantize as Q
from jaxq.quantize import QConfig, QuantizeError, Scheme

RNG = np.random.default_rng(1)
W1 = (RNG.normal(size=(8, 16)) * 0.4).astype(np.float32)
W2 = (RNG.normal(size=(16, 4)) * 0.4).astype(np.float32)
K = (RNG.normal(size=(3, 3, 2, 4)) * 0.4).astype(np.float32)
X = RNG.normal(size=(5, 8)).astype(np.float32)
IMG = RNG.normal(size=(3, 6, 6, 2)).astype(np.float32)


def mlp(params, x):
    with jax.named_scope("Dense_0"):
        x = jax.nn.relu(x @ params["w1"])
    with jax.named_scope("Dense_1"):
        return x @ params["w2"]


def cnn(params, x):
    y = lax.conv_general_dilated(
        x, params["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.mean(jax.nn.relu(y), axis=(1, 2))


CONFIGS = {
    "static": dict(config=QConfig()),
    "fixed_point": dict(config=QConfig(requantize="fixed_point"), closure=True),
    "dynamic": dict(config=QConfig(dynamic=True)),
    "token": dict(
        config=QConfig(dynamic=True, activations=Scheme(granularity="token", symmetric=False))
    ),
    "weights": dict(config=QConfig(activations=None)),
}


@functools.cache
def make(kind, mode, model="mlp"):
    f, params, x = (mlp, {"w1": W1, "w2": W2}, X) if model == "mlp" else (cnn, {"k": K}, IMG)
    opts = CONFIGS[kind]
    calib = [(x,), (x * 1.5,)]
    if opts.get("closure"):
        return Q(
            functools.partial(f, params),
            calibration=calib,
            config=opts["config"],
            mode=mode,
            progress=False,
        )
    return Q(f, params, calibration=calib, config=opts["config"], mode=mode, progress=False)


@pytest.mark.parametrize("mode", ["realize", "simulate"])
@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nonfinite_row_is_nan_and_the_others_do_not_change(kind, mode, bad):
    qf = make(kind, mode)
    x = X.copy()
    x[1, 3] = bad
    clean = X.copy()
    clean[1] = 0.0  # what the other rows must see: as if that row were zeros
    got, want = np.asarray(jax.jit(qf)(x)), np.asarray(jax.jit(qf)(clean))
    assert np.all(np.isnan(got[1])), (kind, mode, got[1])
    rows = [0, 2, 3, 4]
    np.testing.assert_array_equal(got[rows], want[rows])


@pytest.mark.parametrize("mode", ["realize", "simulate"])
@pytest.mark.parametrize(
    "f, x",
    [
        (lambda p, x: (p["w"] @ x.T).T, X),  # (the rows' axis moves: their flags must move too)
        (lambda p, x: (x.reshape(-1, 8) @ p["w"].T).reshape(2, 5, 16), np.stack([X, X[::-1]])),
    ],
    ids=["transposed", "samples_into_rows"],
)
def test_a_nonfinite_row_reached_through_moved_axes_spoils_no_other(f, x, mode):
    """(Realize's int8 chains kept one flag per sample and, where a transpose or reshape moved
    the samples, one for the whole tensor: one NaN made every output NaN.)"""
    params = {"w": W1.T.copy()}
    qf = Q(f, params, calibration=[(x,)], mode=mode, progress=False)
    bad = x.copy()
    bad.reshape(-1, 8)[3, 2] = np.nan
    got, want = np.asarray(qf(bad)).reshape(-1, 16), np.asarray(qf(x)).reshape(-1, 16)
    assert np.isnan(got[3]).all()
    np.testing.assert_array_equal(np.delete(got, 3, 0), np.delete(want, 3, 0))


@pytest.mark.parametrize("kind", ["static", "fixed_point", "dynamic"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_one_row_batch_is_nan_too(kind, bad):
    # batch 1 takes the f32-sum route, whose NaN codes make the row NaN without a mask
    qf = make(kind, "realize")
    x = X[1:2].copy()
    x[0, 3] = bad
    assert np.all(np.isnan(np.asarray(jax.jit(qf)(x))))
    row = np.asarray(jax.jit(qf)(X[2:3]))
    assert np.all(np.isfinite(row))
    if kind != "dynamic":  # (static scales: a row's result does not depend on its batch)
        np.testing.assert_array_equal(row, np.asarray(jax.jit(qf)(X))[2:3])


@pytest.mark.xla_cpu
def test_a_one_row_batch_needs_no_nan_mask():
    # the second layer's input is not carried as int8 codes from the first (a chain needs a NaN
    # mask, a reduction): at one row both layers quantize floats into f32 codes that hold NaN
    qf = make("static", "realize")
    reductions = lambda n: re.findall(r"\breduce_\w+", str(qf.specialize(X[:n]).jaxpr))
    assert reductions(1) == [] and "reduce_or" in reductions(5)  # (5 rows: the s8 kernel)


@pytest.mark.parametrize("mode", ["realize", "simulate"])
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_a_nonfinite_sample_of_a_convolution_is_nan_and_the_others_do_not_change(kind, mode):
    qf = make(kind, mode, "cnn")
    x = IMG.copy()
    x[2, 1, 4, 0] = np.nan
    clean = IMG.copy()
    clean[2] = 0.0
    got, want = np.asarray(qf(x)), np.asarray(qf(clean))
    assert np.all(np.isnan(got[2]))
    np.testing.assert_array_equal(got[:2], want[:2])


@pytest.mark.xla_cpu
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_nan_rows_false_drops_the_check_and_nothing_else(model):
    f, params, x = (mlp, {"w1": W1, "w2": W2}, X) if model == "mlp" else (cnn, {"k": K}, IMG)
    calib = [(x,), (x * 1.5,)]
    fast = {
        mode: Q(
            f, params, calibration=calib, config=QConfig(nan_rows=False), mode=mode, progress=False
        )
        for mode in ("realize", "simulate")
    }
    for rows in (x, x[:1]):  # (one row: the f32-sum route)
        for mode, qf in fast.items():  # finite rows: the same numbers as with the check
            want = np.asarray(jax.jit(make("static", mode, model))(rows))
            np.testing.assert_array_equal(np.asarray(jax.jit(qf)(rows)), want)
    checked = make("static", "realize", model)
    bad = x.copy()
    bad[(0,) * x.ndim] = np.nan
    assert np.isnan(np.asarray(jax.jit(checked)(bad))[0]).all()
    if model == "mlp":  # (int8 codes of NaN are finite: so is the row now)
        assert not np.isnan(np.asarray(jax.jit(fast["realize"])(bad))).any()
    text = str(jax.make_jaxpr(fast["realize"].apply)(fast["realize"].params, x))
    assert "is_finite" not in text and "reduce_max" not in text
    with pytest.raises(TypeError, match="nan_rows must be True or False"):
        QConfig(nan_rows=0)


@settings(max_examples=examples(20), deadline=None)
@given(st.integers(0, 4), st.floats(-50, 50, allow_nan=False, width=32), st.integers(0, 7))
def test_per_token_rows_are_independent(row, value, col):
    qf = make("token", "realize")
    x = X.copy()
    x[row, col] = value
    got, want = np.asarray(qf(x)), np.asarray(qf(X))
    others = [r for r in range(5) if r != row]
    np.testing.assert_array_equal(got[others], want[others])


def test_calibration_refuses_nonfinite_data_naming_layer_and_batch():
    x = X.copy()
    x[0, 0] = np.inf
    with pytest.raises(QuantizeError, match=r"Dense_0/dot_general.*batch 1"):
        Q(mlp, {"w1": W1, "w2": W2}, calibration=[(X,), (x,)], progress=False)


def test_report_shows_the_share_of_clipped_activations():
    qf = make("static", "realize")
    inside = qf.report(sample=(X,))
    assert all(r.clipped == 0.0 for r in inside.layers)
    far = qf.report(sample=(X * 10,))
    clipped = {r.name: r.clipped for r in far.layers}
    assert clipped["Dense_0/dot_general"] > 0.3  # inputs 10x the calibrated range
    assert "clipped %" in str(far)
    assert qf.clipped(X * 10) == clipped


def test_check_saturation_warns_past_the_threshold():
    qf = make("static", "realize")
    assert all(v == 0.0 for v in qf.check_saturation(X).values())  # calibrated range: silent
    with pytest.warns(UserWarning, match=r"Dense_0/dot_general \d+\.\d%.*outside the calibrated"):
        qf.check_saturation(X * 10, threshold=0.05)


@pytest.mark.parametrize("mode", ["realize", "simulate"])
@pytest.mark.parametrize("model", ["dense", "conv"])
def test_a_nan_in_a_wide_row_is_nan_too(mode, model):
    # XLA:CPU's max of a row about 1000 wide or more drops NaN: the row check is a sum
    rng = np.random.default_rng(2)
    if model == "dense":
        x, w = rng.normal(size=(4, 1100)), rng.normal(size=(1100, 6)) * 0.03
        f = lambda p, x: x @ p
    else:  # (12 * 12 * 8 = 1152 values per sample)
        x, w = rng.normal(size=(3, 12, 12, 8)), rng.normal(size=(3, 3, 8, 6)) * 0.1
        dn = ("NHWC", "HWIO", "NHWC")
        f = lambda p, x: lax.conv_general_dilated(x, p, (1, 1), "SAME", dimension_numbers=dn)
    x, w = x.astype(np.float32), w.astype(np.float32)
    qf = Q(f, w, calibration=[(x,)], mode=mode, progress=False)
    bad = x.copy()
    bad.reshape(len(x), -1)[1, 500] = np.nan  # (a NaN and no Inf: what max dropped)
    got = np.asarray(jax.jit(qf)(bad))
    assert np.isnan(got[1]).all()
    assert np.isfinite(np.delete(got, 1, axis=0)).all()


def test_asymmetric_ranges_wider_than_float32_get_finite_scales():
    """``hi - lo`` of a finite range can overflow (``[-2e38, 2e38]``); its scale took 1.0 as a
    non-finite range would, clipping every value, where the symmetric scheme was fine."""
    x = np.array([[2e38, -2e38, 1e38, -1e38], [-1.5e38, 1.5e38, 5e37, 3e37]], np.float32)
    w = (RNG.normal(size=(4, 3)) * 1e-3).astype(np.float32)
    dense = lambda p, x: x @ p["w"]
    want = dense({"w": w}, x)
    config = QConfig(activations=Scheme(symmetric=False))
    qf = Q(dense, {"w": w}, calibration=[(x,)], config=config, progress=False)
    assert float(qf.params["w"].act_scale) > 1e36
    assert np.abs(np.asarray(qf(x)) - want).max() < 0.02 * np.abs(want).max()
    wide = np.array([[3e38, -3e38], [1e38, 2e38]], np.float32)
    config = QConfig(weights=Scheme(symmetric=False, granularity="channel"), activations=None)
    qw = Q(
        dense,
        {"w": wide},
        example_args=(np.ones((1, 2), np.float32),),
        config=config,
        progress=False,
    )
    np.testing.assert_allclose(np.asarray(qw.params["w"].dequantize()), wide, rtol=0.01)
