"""Per-layer SQNR and the sensitivity search that keeps the most harmful layers in float."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxq.quantize import QConfig, Rule, Scheme, quantize
from jaxq.quantize._sensitivity import layer_sqnr, sensitivity, sqnr_db

rng = np.random.default_rng(0)
W0 = rng.standard_normal((16, 32)).astype(np.float32) * 0.3
W1 = rng.standard_normal((32, 32)).astype(np.float32) * 0.3
W1[:, 0] *= 200.0  # one outlier channel makes per-tensor 3-bit weights of layer 1 very poor
W2 = rng.standard_normal((32, 8)).astype(np.float32) * 0.3
X = [rng.standard_normal((8, 16)).astype(np.float32) for _ in range(3)]


def f(x):
    for i, w in enumerate((W0, W1, W2)):
        with jax.named_scope(f"Dense_{i}"):
            x = x @ w
            if i < 2:
                x = jnp.tanh(x)
    return x


CFG = QConfig(weights=Scheme(bits=3, granularity="tensor"), activations=None)


def _fake3(w):
    """3-bit symmetric per-tensor fake quantization: codes [-4, 3], scale max|w| / 3."""
    s = np.abs(w).max() / 3
    return np.clip(np.round(w / s), -4, 3) * s


def test_sqnr_db_definition():
    ref = np.array([1.0, -2.0, 3.0])
    assert sqnr_db(ref, ref) == math.inf
    assert sqnr_db(ref, ref + 0.1) == pytest.approx(10 * np.log10(14.0 / 0.03))


def test_layer_sqnr_measures_each_quantized_layer_output():
    sim = quantize(f, calibration=[(x,) for x in X], config=CFG, mode="simulate", progress=False)
    sqnr = layer_sqnr(f, sim, X[0])
    assert set(sqnr) == {"Dense_0/dot_general", "Dense_1/dot_general", "Dense_2/dot_general"}
    assert all(np.isfinite(v) for v in sqnr.values())
    # the first layer's SQNR is its own error: check it against a direct computation
    ref = X[0] @ W0
    assert sqnr["Dense_0/dot_general"] < 40  # 3-bit weights are visibly noisy
    assert sqnr["Dense_0/dot_general"] == pytest.approx(
        sqnr_db(ref, jax.jit(lambda x: x @ _fake3(W0))(X[0])), abs=1e-3
    )
    real = quantize(f, calibration=[(x,) for x in X], config=CFG, progress=False)
    with pytest.raises(ValueError, match="mode='simulate'"):
        layer_sqnr(f, real, X[0])


def test_sensitivity_keeps_the_worst_layer_float_until_the_target_is_met():
    ref = jax.jit(f)(X[0])

    def metric(qf):
        return -float(jnp.max(jnp.abs(jax.jit(qf)(X[0]) - ref)))  # higher is better

    full = quantize(f, calibration=[(x,) for x in X], config=CFG, progress=False)
    err_full = -metric(full)
    result = sensitivity(
        f, calibration=[(x,) for x in X], config=CFG, metric=metric, target=-err_full / 4
    )
    assert result.met and result.kept_float[0] == "Dense_1/dot_general"
    assert result.history[0] == (0, pytest.approx(-err_full))
    assert result.metric >= -err_full / 4
    statuses = {r.name: r.status for r in result.function.report().layers}
    assert statuses["Dense_1/dot_general"] != "quantized"
    assert "kept in float: Dense_1/dot_general" in str(result)
    again = quantize(f, calibration=[(x,) for x in X], config=result.config, progress=False)
    assert metric(again) == result.metric  # (the config found, reusable)


def test_sensitivity_with_params_as_an_argument():
    """The README's style, ``f(params, x)``: the same search, on params kept as arguments."""

    def g(params, x):
        for i, w in enumerate(params):
            with jax.named_scope(f"Dense_{i}"):
                x = x @ w
                if i < 2:
                    x = jnp.tanh(x)
        return x

    ref = jax.jit(f)(X[0])
    metric = lambda qf: -float(jnp.max(jnp.abs(jax.jit(qf)(X[0]) - ref)))
    calib = [(x,) for x in X]
    want = sensitivity(f, calibration=calib, config=CFG, metric=metric, target=-1e-2)
    got = sensitivity(g, [W0, W1, W2], calibration=calib, config=CFG, metric=metric, target=-1e-2)
    assert got.kept_float == want.kept_float and got.kept_float[0] == "Dense_1/dot_general"
    assert got.function.params is not None  # (a function of params, not of constants)
    assert [k for k, _ in got.history] == [k for k, _ in want.history]
    np.testing.assert_allclose([m for _, m in got.history], [m for _, m in want.history], atol=1e-6)


def test_sensitivity_reports_an_unreachable_target():
    result = sensitivity(
        f, calibration=[(x,) for x in X], config=CFG, metric=lambda qf: 0.0, target=1.0, max_kept=1
    )
    assert not result.met and len(result.history) == 2 and len(result.kept_float) == 1
    with pytest.raises(ValueError, match="calibration is empty"):
        sensitivity(f, calibration=[], config=CFG, metric=lambda qf: 0.0, target=1.0)


def test_sensitivity_with_a_fallback_keeps_the_worst_layer_at_more_bits():
    """Mixed precision: the harmful layer gets 8-bit weights instead of float (ONNX Runtime runs
    7-bit weights fastest without VNNI; a 4-bit model keeps its worst layers at 8)."""
    ref = jax.jit(f)(X[0])
    metric = lambda qf: -float(jnp.max(jnp.abs(jax.jit(qf)(X[0]) - ref)))
    calib = [(x,) for x in X]
    w8 = Rule(weights=Scheme(bits=8, granularity="channel"))
    full = -metric(quantize(f, calibration=calib, config=CFG, progress=False))
    result = sensitivity(
        f, calibration=calib, config=CFG, metric=metric, target=-full / 4, fallback=w8
    )
    assert result.met and result.kept[0] == "Dense_1/dot_general" and result.kept_float == ()
    for r in result.function.report().layers:  # the kept at 8 bits, the rest at 3
        assert r.status == "quantized"
        assert r.weights.startswith("int8 " if r.name in result.kept else "int3 ")
    assert "kept at weights=Scheme(bits=8" in str(result)
    # the same layers at 8 bits by hand: the same numbers
    rules = tuple(Rule(pattern=f"^{n}$", weights=w8.weights) for n in result.kept)
    want = quantize(
        f, calibration=calib, config=dataclasses.replace(CFG, rules=rules), progress=False
    )
    np.testing.assert_array_equal(jax.jit(result.function)(X[1]), jax.jit(want)(X[1]))
    with pytest.raises(ValueError, match="without pattern or primitives"):
        sensitivity(
            f,
            calibration=calib,
            config=CFG,
            metric=metric,
            target=0.0,
            fallback=Rule(pattern="Dense", skip=True),
        )
    with pytest.raises(ValueError, match="changes nothing"):
        sensitivity(f, calibration=calib, config=CFG, metric=metric, target=0.0, fallback=Rule())


def test_sensitivity_checks_its_arguments_as_quantize_does():
    """One array as calibration was taken row by row as 16 batches (quantize refuses it); a
    negative max_kept failed a bare assert; a bare array as sample was unpacked row by row."""
    x = np.concatenate(X)
    metric = lambda qf: 0.0
    with pytest.raises(
        TypeError,
        match=r"calibration must be an iterable of argument tuples.*"
        r"one array: wrap each batch in a tuple",
    ):
        sensitivity(f, calibration=x, config=CFG, metric=metric, target=1.0)
    with pytest.raises(ValueError, match="max_kept must be an int >= 0 or None; got -1"):
        sensitivity(f, calibration=[(X[0],)], config=CFG, metric=metric, target=1.0, max_kept=-1)
    one = sensitivity(
        f, calibration=[(X[0],)], config=CFG, metric=metric, target=1.0, max_kept=0, sample=X[1]
    )
    tup = sensitivity(
        f, calibration=[(X[0],)], config=CFG, metric=metric, target=1.0, max_kept=0, sample=(X[1],)
    )
    assert one.sqnr_db == tup.sqnr_db and one.isolated_sqnr_db == tup.isolated_sqnr_db
