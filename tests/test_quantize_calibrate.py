"""Calibration: streaming observers with bounded memory, the four methods, the pass alone."""

import re
import sys
import types

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import examples

import jaxq
import jaxq.quantize as Q
from jaxq.quantize import QConfig, Scheme
from jaxq.quantize._observers import NBINS, Observer, batch_stats
from jaxq.quantize._state import get_state

RNG = np.random.default_rng(1)
W = (RNG.normal(size=(8, 4)) * 0.5).astype(np.float32)
stats_fn = jax.jit(batch_stats)


def layer(x):
    with jax.named_scope("L"):
        return x @ W


def observe(batches, method_hist=True):
    o = Observer("t", method_hist)
    for b in batches:
        s = jax.device_get(stats_fn(b, None))
        r = o.radius_for(float(s["min"]), float(s["max"]))
        o.set_radius(r)
        o.update(jax.device_get(stats_fn(b, np.float32(o.radius))))
    return o


@settings(max_examples=examples(10))
@given(st.lists(st.floats(0.01, 50.0), min_size=1, max_size=5), st.integers(0, 1000))
def test_histogram_is_bounded_and_conserves_counts(scales, seed):
    rng = np.random.default_rng(seed)
    batches = [(rng.normal(size=(64,)) * s).astype(np.float32) for s in scales]
    o = observe(batches)
    data = np.concatenate(batches)
    assert o.hist.shape == (NBINS,) and o.hist.sum() == data.size
    assert o.min == data.min() and o.max == data.max()
    assert o.radius >= np.abs(data).max()
    # every value still sits in a bin whose edges contain it (re-binning is exact pairwise merging)
    edges = np.linspace(-o.radius, o.radius, NBINS + 1)
    want = np.histogram(np.clip(data, -o.radius, o.radius), edges)[0]
    assert np.abs(want - o.hist).sum() <= 2 * len(batches)  # floating point at bin edges only


def test_percentile_ignores_outliers():
    data = np.concatenate([RNG.uniform(-1, 1, 20000), [100.0]]).astype(np.float32)
    o = observe([data])
    lo, hi = o.value_range("percentile", Scheme(), 99.9)
    assert 0.9 < hi < 1.2 and -1.2 < lo < -0.9
    assert o.value_range("minmax", Scheme(), 99.9) == (float(data.min()), 100.0)
    lo, hi = o.value_range("percentile", Scheme(symmetric=False), 99.9)
    assert 0.9 < hi < 1.2


@pytest.mark.parametrize("method, bits", [("entropy", 8), ("mse", 4)])
def test_entropy_and_mse_clip_long_tails(method, bits):
    # (at 8 bits two outliers cost MSE more clipped than kept: 4 bits makes clipping the optimum)
    data = np.concatenate([RNG.normal(size=50000), [40.0, -35.0]]).astype(np.float32)
    o = observe([data[:25000], data[25000:]])
    lo, hi = o.value_range(method, Scheme(bits=bits), 99.99)
    assert 2.0 < hi < 20.0 and -20.0 < lo < -2.0, (lo, hi)


def test_entropy_is_not_ruled_by_a_relus_zeros():
    # (half the values exactly 0 took the threshold from 4.7 to 1.8: 4% clipped, 17 dB)
    g = np.abs(RNG.normal(size=40000)).astype(np.float32)
    relu = np.where(RNG.random(40000) < 0.5, 0.0, g).astype(np.float32)
    his = [observe([x]).value_range("entropy", Scheme(), 99.99)[1] for x in (g, relu)]
    assert his[1] > 0.8 * his[0], his


@pytest.mark.parametrize("values", [(0.0, 1.0), (3.0,), (0.0, 0.5, 1.0)])
def test_entropy_keeps_the_range_of_discrete_values(values):
    # (binary features, a constant, three levels: no threshold below the largest value loses
    # less information, and the search skipped "no clipping" where its step missed the last bin)
    x = RNG.choice(np.asarray(values, np.float32), size=5000, p=None)
    lo, hi = observe([x]).value_range("entropy", Scheme(), 99.99)
    assert hi >= max(values) and lo <= min(values), (lo, hi)


def test_entropy_of_an_all_zero_input():
    # (a dead ReLU's input: bin 0 holds every value, and took bin 1's count, none)
    lo, hi = observe([np.zeros(1000, np.float32)]).value_range("entropy", Scheme(), 99.99)
    assert np.isfinite(hi) and hi >= 0 and lo <= 0


def test_methods_end_to_end_and_streaming_minmax():
    xs = [RNG.normal(size=(16, 8)).astype(np.float32) * (i + 1) for i in range(3)]
    prog = Q.annotate(QConfig())(jaxq.trace(layer, xs[0]))
    scales = {}
    for method in ("minmax", "percentile", "entropy", "mse"):
        out = Q.calibrate([(x,) for x in xs], method, progress=False)(prog)
        a = get_state(out, "t").act["L/dot_general"]
        assert np.isfinite(a.scale) and a.scale > 0
        scales[method] = a.scale
        assert get_state(out, "t").calibration["method"] == method
    allx = np.concatenate(xs)
    assert scales["minmax"] == pytest.approx((allx.max() - allx.min()) / 255, rel=1e-6)
    assert scales["percentile"] <= scales["minmax"] * (1 + 1e-6)


def test_calibration_batches_of_other_shapes_and_progress(capsys):
    cal = [(RNG.normal(size=(n, 8)).astype(np.float32),) for n in (5, 3, 5)]
    qf = Q(layer, calibration=cal, progress=True)
    assert get_state(qf.program, "t").calibration["batches"] == 3
    assert "jaxq calibrate" in capsys.readouterr().err
    assert qf(cal[1][0]).shape == (3, 4)


@pytest.mark.parametrize("style", ["closure", "params"])
def test_progress_bar_knows_how_many_batches_a_list_holds(style, monkeypatch):
    totals = []

    class Bar:  # (a stand-in for tqdm: records the total tqdm would take from len())
        def __init__(self, it, **kwargs):
            self.it = it
            totals.append(len(it) if hasattr(it, "__len__") else None)

        def __iter__(self):
            return iter(self.it)

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=Bar))
    cal = [(RNG.normal(size=(2, 8)).astype(np.float32),) for _ in range(3)]
    if style == "closure":
        Q(layer, calibration=cal, progress=True)
        Q(layer, calibration=iter(cal), progress=True)  # (a generator: no total)
    else:
        w = RNG.normal(size=(8, 4)).astype(np.float32)
        Q(lambda w, x: x @ w, w, calibration=cal, progress=True)
        Q(lambda w, x: x @ w, w, calibration=iter(cal), progress=True)
    assert totals == [3, None]


def test_param_progress_counts_weights(capsys):
    """Quantizing params shows its own progress (more than 8 weights), counted in weights."""
    params = [RNG.normal(size=(8, 8)).astype(np.float32) for _ in range(9)]

    def stack(ps, x):
        for w in ps:
            x = x @ w
        return x

    Q(stack, params, calibration=[(RNG.normal(size=(2, 8)).astype(np.float32),)], progress=True)
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines()[::-1] if "jaxq quantize params" in ln)
    assert re.search(r"\b9\b.*weight", line), line  # tqdm: "9/9 [... weight/s]"; else "9 weights"


def test_dynamic_needs_no_calibration():
    x = RNG.normal(size=(4, 8)).astype(np.float32)
    qf = Q(layer, config=QConfig(dynamic=True), example_args=(x,), progress=False)
    row = qf.report().layers[0]
    assert row.activations.endswith("dynamic") and row.activation_scale is None
    np.testing.assert_allclose(np.asarray(qf(x)), np.asarray(layer(x)), atol=0.05)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("mode", ["realize", "simulate"])
def test_dynamic_scales_of_an_empty_batch(symmetric, mode):
    # a serving loop's empty batch: zero rows give zero outputs, not a reduction error
    cfg = QConfig(dynamic=True, activations=Scheme(symmetric=symmetric))
    f = lambda p, x: x @ p
    qf = Q(f, W, example_args=(np.ones((4, 8), np.float32),), config=cfg, mode=mode)
    for fn in (qf, jax.jit(qf)):
        assert fn(np.zeros((0, 8), np.float32)).shape == (0, 4)


def test_pass_context_sets_the_method():
    x = RNG.normal(size=(16, 8)).astype(np.float32)
    prog = Q.annotate(QConfig())(jaxq.trace(layer, x))
    with jaxq.transform.PassContext(config={"quantize.calibrate.method": "mse"}):
        out = Q.calibrate([(x,)], progress=False)(prog)
    assert get_state(out, "t").calibration["method"] == "mse"
    assert (
        get_state(Q.calibrate([(x,)], progress=False)(prog), "t").calibration["method"] == "minmax"
    )


def test_unsigned_symmetric_activations_that_go_negative_warn():
    """Codes from 0 with zero point 0 clip every negative value: say so at calibration, for the
    inputs that have them only (a ReLU's output is fine)."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(8, 8)).astype(np.float32)
    x = rng.normal(size=(16, 8)).astype(np.float32)

    def f(w, x):
        with jax.named_scope("first"):
            h = jax.nn.relu(x @ w)
        with jax.named_scope("second"):
            return h @ w

    cfg = QConfig(activations=Scheme(signed=False, symmetric=True))
    with pytest.warns(UserWarning, match=r"1 activation\(s\) .* first/dot_general \(min -") as rec:
        Q(f, w, calibration=[(x,)], config=cfg, progress=False)
    assert not any("second" in str(r.message) for r in rec)
    assert rec[0].filename == __file__  # (the user's line)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("p", [50.0, 90.0, 99.0])
def test_percentile_keeps_that_share_of_the_values(symmetric, p):
    """``percentile=p`` keeps p% of the calibration values (asymmetric: (100 - p) / 2 % cut from
    each tail), within a histogram bin's width."""
    data = RNG.normal(size=40000).astype(np.float32)
    lo, hi = observe([data]).value_range("percentile", Scheme(symmetric=symmetric), p)
    kept = 100 * np.mean((data >= lo) & (data <= hi))
    assert abs(kept - p) < 1.0, (lo, hi, kept)
    if not symmetric:  # the two tails lose alike
        assert abs(np.mean(data < lo) - np.mean(data > hi)) < 0.01
