"""End to end: annotate / calibrate / realize, realized vs simulated, QAT, re-specialization."""

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from strategies import examples, programs

import jaxq
import jaxq.quantize as Q
from jaxq import _cpu
from jaxq.annotate import simulated_quantize
from jaxq.quantize import QConfig, QuantizeError, Rule, Scheme, Tuning
from jaxq.quantize._state import get_state
from jaxq.quantize._tuning import TABLE as TUNING_TABLE
from jaxq.transform import PassContext

RNG = np.random.default_rng(0)
# (every scheme's arithmetic on signed data, unsigned symmetric activations too: their clipping
# of negative values is what calibration warns about, and what these tests check exactly)
pytestmark = [  # (the properties try every scheme, unsigned symmetric ones on signed data too)
    pytest.mark.filterwarnings(
        r"ignore:.* activation\(s\) quantized unsigned and symmetric:UserWarning"
    ),
    pytest.mark.filterwarnings(r"ignore:quantize. the weight of .* holds negative:UserWarning"),
]
W1 = (RNG.normal(size=(16, 24)) * 0.3).astype(np.float32)
B1 = (RNG.normal(size=(24,)) * 0.1).astype(np.float32)
W2 = (RNG.normal(size=(24, 8)) * 0.3).astype(np.float32)
K1 = (RNG.normal(size=(3, 3, 2, 4)) * 0.3).astype(np.float32)
WC = (RNG.normal(size=(4 * 4 * 4, 8)) * 0.2).astype(np.float32)
X = RNG.normal(size=(6, 16)).astype(np.float32)
XI = RNG.normal(size=(3, 4, 4, 2)).astype(np.float32)


def mlp(x):
    with jax.named_scope("MLP"):
        with jax.named_scope("Dense_0"):
            h = jax.nn.relu(x @ W1 + B1)
        with jax.named_scope("Dense_1"):
            return h @ W2


def cnn(x):
    with jax.named_scope("CNN"):
        with jax.named_scope("Conv_0"):
            h = lax.conv_general_dilated(
                x, K1, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
        h = jax.nn.relu(h).reshape(x.shape[0], -1)
        with jax.named_scope("Dense_0"):
            return h @ WC


ROUTES = Tuning(float_carry_max_rows=1, s8_conv_min_channels=17, conv_im2col_bytes=(0, 0))
"""Pins realize's lowering choices (XLA's s8 convolutions from 17 output channels, no im2col dots),
so the tests of each route check it whatever the running jax's tuning entry chooses."""
IM2COL = dataclasses.replace(ROUTES, conv_im2col_bytes=(0, 4 << 20))
"""The same, with convolutions of up to 4 MiB of windows as s8 dots."""


def pinned(tuning=ROUTES):
    return PassContext(config={"quantize.tuning": tuning})


def both(f, cal, config, **kw):
    kw.setdefault("progress", False)
    r = Q(f, calibration=cal, config=config, **kw)
    s = Q(f, calibration=cal, config=config, mode="simulate", **kw)
    return r, s


# ---- exactness: realized integer arithmetic equals the simulated quantization ---------------------


def reference_dense(x, state, name, weight):
    """Integer reference for one dense layer from the *simulated* quantized operands."""
    site = state.sites[name]
    act = state.act[name]
    qw = state.weights[name]
    s = site.activations
    xa = simulated_quantize(
        x,
        act.scale,
        act.zero_point,
        bits=s.bits,
        signed=s.signed,
        rounding=s.rounding,
        narrow_range=s.narrow_range,
    )
    ca = np.rint(np.asarray(xa, np.float64) / np.float32(act.scale)).astype(np.int64)  # q - za
    w_fq = (qw.codes.astype(np.float32) - qw.zero_point) * qw.scale  # simulated weight value
    cw = np.rint(w_fq.astype(np.float64) / qw.scale).astype(np.int64)  # q - zw
    acc = ca @ cw
    scale = np.float32(act.scale) * qw.scale.reshape(1, -1).astype(np.float32)
    return acc.astype(np.float32) * scale


SCHEMES = st.builds(
    lambda bits, signed, sym, rnd: Scheme(bits=bits, signed=signed, symmetric=sym, rounding=rnd),
    st.sampled_from([8, 4]),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["nearest_even", "half_away_from_zero", "half_up", "floor"]),
)


@settings(max_examples=examples(12))
@given(
    st.sampled_from([1, 3]),
    SCHEMES,
    st.sampled_from(["tensor", "channel"]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_realized_equals_integer_reference_exactly(m, act, gran, wsym, seed):
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(12, 5)) * rng.uniform(0.05, 2)).astype(np.float32)
    x = (rng.normal(size=(m, 12)) + rng.uniform(-1, 1)).astype(np.float32)

    def layer(v):
        with jax.named_scope("L"):
            return v @ w

    wscheme = Scheme(granularity=gran, symmetric=wsym, rounding=act.rounding)
    qf = Q(
        layer, calibration=[(x,)], config=QConfig(weights=wscheme, activations=act), progress=False
    )
    state = get_state(qf.program, "test")
    got = np.asarray(qf(x))  # eager
    want = reference_dense(x, state, "L/dot_general", w)
    np.testing.assert_array_equal(got, want)


def test_jit_within_float_tolerance():
    r, s = both(mlp, [(X,)], QConfig())
    eager, jitted, sim = np.asarray(r(X)), np.asarray(jax.jit(r)(X)), np.asarray(s(X))
    scale = np.abs(sim).max()
    np.testing.assert_allclose(jitted, eager, atol=1e-5 * scale, rtol=0)
    np.testing.assert_allclose(eager, sim, atol=1e-5 * scale, rtol=0)


GRANS = {
    "tensor": dict(w=Scheme(granularity="tensor"), a=Scheme()),
    "channel": dict(w=Scheme(granularity="channel"), a=Scheme(symmetric=False)),
    "group": dict(w=Scheme(granularity="group", group_size=8), a=Scheme()),
    "token": dict(w=Scheme(granularity="channel"), a=Scheme(granularity="token", symmetric=False)),
}


@pytest.mark.parametrize(
    "gran, rounding", list(itertools.product(GRANS, ["nearest_even", "half_up"]))
)
def test_each_granularity_calibrated_end_to_end(gran, rounding):
    g = GRANS[gran]
    w = Scheme(**{**_fields(g["w"]), "rounding": rounding})
    a = Scheme(**{**_fields(g["a"]), "rounding": rounding})
    cfg = QConfig(weights=w, activations=a, dynamic=gran == "token")
    r, s = both(mlp, [(X,)], cfg)
    out_r, out_s, ref = np.asarray(r(X)), np.asarray(s(X)), np.asarray(mlp(X))
    assert out_r.shape == ref.shape and np.all(np.isfinite(out_r))
    np.testing.assert_allclose(out_r, out_s, atol=1e-4 * np.abs(ref).max())
    assert np.abs(out_r - ref).max() < 0.25 * np.abs(ref).max()


@pytest.mark.parametrize("symmetric", [True, False])
def test_group_weights_with_static_activations_compute_as_simulated(symmetric):
    """Group scales along the contracted axis: realize ran one int32 dot per group and wrote out
    their [groups, rows, out] sums (W4 group(32) A8 at 2048 x 2048: 0.09x float, 256 MiB of
    temporaries). It computes the float dot on the dequantized codes, as simulated, instead (the
    same numbers, up to the order XLA sums them in)."""
    w = {"w": (RNG.normal(size=(64, 24)) * 0.1).astype(np.float32)}
    x = RNG.normal(size=(8, 64)).astype(np.float32)
    cfg = QConfig(weights=Scheme(bits=4, granularity="group", group_size=16, symmetric=symmetric))
    f = lambda p, x: jax.nn.relu(x @ p["w"])  # noqa: E731
    qf = Q(f, w, calibration=[(x,)], config=cfg, progress=False)
    qs = Q(f, w, calibration=[(x,)], config=cfg, progress=False, mode="simulate")
    got, want = np.asarray(jax.jit(qf.apply)(qf.params, x)), np.asarray(jax.jit(qs.apply)(w, x))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())  # (XLA's order)
    dots = [e for e in qf.program.equations() if e.primitive == "dot_general"]
    assert [e.params["dimension_numbers"][1] for e in dots] == [((), ())]  # (no batch of groups)


def test_group_granularity_from_the_config_is_per_channel_where_it_does_not_apply():
    # a 3-D kernel (Flax DenseGeneral in attention), a convolution and a matmul whose contracted
    # size the groups do not divide (Mamba's dt_proj: it raised): per channel, said once, while
    # the 2-D matmul keeps its groups
    k3 = (RNG.normal(size=(8, 2, 3)) * 0.3).astype(np.float32)

    def f(x):
        h = cnn(x)
        with jax.named_scope("Heads"):
            h = jnp.einsum("bk,knd->bnd", h, k3)
        with jax.named_scope("Out"):
            h = h.reshape(h.shape[0], -1) @ W1[:6, :7]
        with jax.named_scope("Narrow"):
            return h @ W1[:7, :3]

    grouped = Scheme(bits=4, granularity="group", group_size=2)
    with pytest.warns(UserWarning, match=r"3 layer\(s\) get one weight scale per channel.*Conv_0"):
        qf = Q(f, calibration=[(XI,)], config=QConfig(weights=grouped), progress=False)
    schemes = {r.name: r.weights for r in qf.report().layers}
    assert schemes == {
        "CNN/Conv_0/conv_general_dilated": "int4 sym channel",
        "CNN/Dense_0/dot_general": "int4 sym group(2)",
        "Heads/bk,knd->bnd/dot_general": "int4 sym channel",
        "Out/dot_general": "int4 sym group(2)",
        "Narrow/dot_general": "int4 sym channel",
    }, schemes
    site = get_state(qf.program, "t").sites["Heads/bk,knd->bnd/dot_general"]
    assert site.scale_axes == (1, 2)  # (every output axis, as Rule(granularity="channel"))
    k3_scales = np.abs(k3).max(0) / 7
    lo, hi = next(r.weight_scale for r in qf.report().layers if r.name.startswith("Heads"))
    assert (lo, hi) == pytest.approx((k3_scales.min(), k3_scales.max()), rel=1e-6)


def _fields(s):
    return {
        f: getattr(s, f)
        for f in (
            "bits",
            "signed",
            "symmetric",
            "granularity",
            "group_size",
            "narrow_range",
            "rounding",
        )
    }


@settings(max_examples=examples(4))
@given(SCHEMES, SCHEMES, st.sampled_from(["tensor", "channel"]))
def test_conv_schemes_realized_vs_simulated(w, a, gran):
    w = Scheme(**{**_fields(w), "granularity": gran})
    r, s = both(cnn, [(XI,)], QConfig(weights=w, activations=a))
    out_r, out_s = np.asarray(r(XI)), np.asarray(s(XI))
    np.testing.assert_allclose(out_r, out_s, atol=1e-4 * max(np.abs(out_s).max(), 1e-3))


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_matches_simulated(bits):
    # realize runs the float op on the codes and scales the output per channel: the simulated
    # result up to float reassociation
    cfg = QConfig(weights=Scheme(bits=bits, granularity="channel"), activations=None)
    r, s = both(cnn, None, cfg, example_args=(XI,))
    out_r, out_s = np.asarray(r(XI)), np.asarray(s(XI))
    np.testing.assert_allclose(out_r, out_s, rtol=1e-5, atol=1e-5 * np.abs(out_s).max())
    assert "int8" in str(r.program)


@pytest.mark.parametrize("rounding", ["nearest_even", "half_up", "half_away_from_zero"])
def test_activation_codes_at_exact_ties_are_the_same_realized_and_simulated(rounding):
    # (float32 inputs with x / s exactly k + 1/2 but x * (1 / s) not: realize divided by its
    # scale, given at run time, where simulate's was a constant XLA multiplied by the reciprocal)
    k = 128
    f = lambda p, x: x @ p["w"]
    params = {"w": np.eye(k, dtype=np.float32)}  # (the output: the dequantized input codes)
    calib = [(np.linspace(-2, 2, 2 * k, dtype=np.float32).reshape(2, k),)]
    cfg = QConfig(activations=Scheme(symmetric=True, rounding=rounding))
    r = jaxq.quantize(f, params, calibration=calib, config=cfg, progress=False)
    s = jaxq.quantize(f, params, calibration=calib, config=cfg, mode="simulate", progress=False)
    sa = np.float32(r.params["w"].act_scale)
    half = np.float32((np.arange(-120, 120) + 0.5) * np.float64(sa))
    near = (half[:, None] + np.arange(-4, 5) * np.spacing(half)[:, None]).astype(np.float32)
    ties = near[(near / sa % 1 == 0.5) & (near * (1 / sa) != near / sa)]
    assert ties.dtype == np.float32 and len(ties) >= 8
    x = np.zeros((1, k), np.float32)
    x[0, : min(len(ties), k)] = ties[:k]
    np.testing.assert_array_equal(jax.jit(r.apply)(r.params, x), jax.jit(s.apply)(s.params, x))


# ---- simulate mode ----------------------------------------------------------------------------------


@settings(max_examples=examples(10))
@given(SCHEMES, st.integers(0, 2**16))
def test_simulated_error_within_half_scale(scheme, seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(8, 16)) * 3).astype(np.float32)

    def ident(v):
        with jax.named_scope("L"):
            return v @ np.eye(16, dtype=np.float32)

    qf = Q(
        ident,
        calibration=[(x,)],
        config=QConfig(activations=scheme, weights=Scheme(granularity="channel")),
        mode="simulate",
        progress=False,
    )
    act = get_state(qf.program, "t").act["L/dot_general"]
    qmin, qmax = scheme.qrange
    lo, hi = (qmin - act.zero_point) * act.scale, (qmax - act.zero_point) * act.scale
    err = np.abs(np.asarray(qf(x)) - x)
    inside = (x >= lo) & (x <= hi)
    bound = act.scale * (1.0 if scheme.rounding == "floor" else 0.5) * (1 + 1e-5) + 1e-6
    assert np.all(err[inside] <= bound)


def test_qat_gradient_equals_ste_reference():
    qs = Q(mlp, calibration=[(X,)], mode="simulate", progress=False)
    g = np.asarray(jax.grad(lambda x: qs(x).sum())(X))
    state = get_state(qs.program, "t")
    wq = {
        n: (w.codes.astype(np.float32) - w.zero_point) * w.scale for n, w in state.weights.items()
    }
    w1, w2 = wq["MLP/Dense_0/dot_general"], wq["MLP/Dense_1/dot_general"]
    # straight-through: quantizers pass gradients unchanged; relu gates them
    h = np.asarray(qs.specialize(X)(X))  # forward runs fine
    pre = _pre_activation(qs, X)
    want = ((np.ones((X.shape[0], 8), np.float32) @ w2.T) * (pre > 0)) @ w1.T
    assert np.all(np.isfinite(g)) and h.shape == (6, 8)
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


def _pre_activation(qs, x):
    state = get_state(qs.program, "t")
    a = state.act["MLP/Dense_0/dot_general"]
    s = state.sites["MLP/Dense_0/dot_general"].activations
    xq = simulated_quantize(x, a.scale, a.zero_point, bits=s.bits, signed=s.signed)
    w = state.weights["MLP/Dense_0/dot_general"]
    return np.asarray(xq) @ ((w.codes.astype(np.float32) - w.zero_point) * w.scale) + B1


# ---- JAX transformations and new shapes ------------------------------------------------------------


def test_jit_vmap_and_new_shapes_reuse_scales():
    qf = Q(mlp, calibration=[(X,)], progress=False)
    before = dict(get_state(qf.program, "t").act)
    x1, x9 = X[:1], RNG.normal(size=(9, 16)).astype(np.float32)
    for x in (x1, x9):
        out = np.asarray(jax.jit(qf)(x))
        assert out.shape == (x.shape[0], 8)
    # batch rows are independent under per-tensor static scales: row 0 is the same at every size
    np.testing.assert_allclose(np.asarray(qf(x1))[0], np.asarray(qf(X))[0], rtol=1e-6)
    assert get_state(qf.specialize(x9), "t").act == before
    v = jax.vmap(qf)(X[:, None])
    np.testing.assert_allclose(np.asarray(v)[:, 0], np.asarray(qf(X)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "carry, pad", [(1, False), (0, True), (0, False)], ids=["f32 sums", "s8 2 rows", "s8 1 row"]
)
def test_one_row_matmul_routes_give_the_same_integers(carry, pad):
    # each route a tuning entry can pick for a batch-1 matmul computes the same integer sums
    x1 = X[:1]
    base = Tuning(float_carry_max_rows=carry, s8_pad_single_row=pad, s8_conv_min_channels=17)
    with pinned(base):
        qf = Q(mlp, calibration=[(X,)], progress=False)
        text = str(qf.specialize(x1))
    assert ("preferred_element_type=float32" in text) == (carry == 1)
    assert ("concatenate" in text) == (carry == 0 and pad)
    many = np.asarray(qf(X))[0]
    np.testing.assert_array_equal(np.asarray(jax.jit(qf)(x1))[0], many)


def test_tuning_table_is_chosen_by_version_and_cpu_and_can_be_given():
    for vnni in (True, False):
        table = [(version, entry) for version, vn, entry in TUNING_TABLE if vn == vnni]
        cpu = lambda version, vnni=vnni: Q.tuning(version, "cpu", vnni)
        assert cpu((0, 0, 1)) == table[0][1]  # older than every entry: the oldest
        assert cpu((99, 0, 0)) == table[-1][1]
        for version, entry in table:
            assert cpu(version) == entry
    # (measured on a 2-core AVX2 EPYC: 16 -> 32 with its pooling ran 1.35x float's time in s8)
    assert Q.tuning((0, 12, 0), "cpu", False) != Q.tuning((0, 12, 0), "cpu", True)
    here = Q.tuning(platform="cpu")
    assert here == Q.tuning(platform="cpu", vnni=_cpu.x86_vnni() is not False)
    with pytest.raises(TypeError, match="quantize.tuning.*Tuning [|] None; got str"):
        pinned("fast")  # (refused when the context is made, before any pass reads it)


def test_partial_and_weight_argnums_agree():
    params = {"w1": W1, "b1": B1, "w2": W2}

    def apply(p, x):
        with jax.named_scope("Dense_0"):
            h = jax.nn.relu(x @ p["w1"] + p["b1"])
        with jax.named_scope("Dense_1"):
            return h @ p["w2"]

    a = Q(functools.partial(apply, params), calibration=[(X,)], progress=False)
    b = Q(apply, calibration=[(params, X)], weight_argnums=0, progress=False)
    np.testing.assert_array_equal(np.asarray(a(X)), np.asarray(b(X)))
    assert len(get_state(b.program, "t").sites) == 2
    two = Q(lambda x, p, s: apply(p, x) * s, calibration=[(X, params, 2.0)], weight_argnums=1)
    with pytest.raises(jaxq.TraceError, match=r"arguments \[0, 2\] besides the weights"):
        two(X)  # (s left out: it raised StopIteration)


def test_nested_jit_weights_are_found():
    inner = jax.jit(lambda x: x @ W2)

    def f(x):
        return inner(jax.nn.relu(x @ W1))

    qf = Q(f, calibration=[(X,)], progress=False)
    assert len(get_state(qf.program, "t").sites) == 2
    np.testing.assert_allclose(np.asarray(qf(X)), np.asarray(f(X)), atol=0.05 * np.abs(f(X)).max())


# ---- realize structure -------------------------------------------------------------------------------


@pytest.mark.xla_cpu
def test_realized_program_structure_and_bytes():
    r8 = Q(cnn, calibration=[(XI,)], progress=False)
    r4 = Q(
        cnn,
        calibration=[(XI,)],
        config=QConfig(weights=Scheme(bits=4, granularity="channel")),
        progress=False,
    )
    text = str(r8.program)
    assert "preferred_element_type=int32" in text and "int8[3,3,2,4]" in text
    assert "simulated_quantize" not in text
    consts = [c for c in r8.program.jaxpr.consts if np.asarray(c).dtype == np.int8]
    assert {np.asarray(c).size for c in consts} == {K1.size, WC.size}
    f32 = K1.nbytes + WC.nbytes
    assert r8.report().param_bytes < 0.4 * f32  # int8 codes + per-channel vectors
    assert r4.report().param_bytes < 0.7 * r8.report().param_bytes  # packed two per byte
    sim = Q(cnn, calibration=[(XI,)], mode="simulate", progress=False)
    assert "simulated_quantize" in str(sim.program)


def test_int4_pack_roundtrip():
    from jaxq.quantize._realize import pack_int4, unpack_int4

    for shape, size in (((5, 7), 18), ((3, 3, 16, 8), 576), ((6,), 3)):
        q = RNG.integers(-8, 8, size=shape).astype(np.int8)
        packed = pack_int4(q)
        assert packed.dtype == np.int8 and packed.size == size
        np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed), shape)), q)


def test_fixed_point_matches_numpy_reference():
    from jaxq.quantize import _fixed_point as F

    def layer(v):
        with jax.named_scope("L"):
            return v @ W1

    cfg = QConfig(requantize="fixed_point")
    qf = Q(layer, calibration=[(X,)], config=cfg, progress=False)
    st_ = get_state(qf.program, "t")
    a, out = st_.act["L/dot_general"], st_.act["L/dot_general:out"]
    qw = st_.weights["L/dot_general"]
    s = cfg.activations
    qa = np.clip(
        np.round(X.astype(np.float32) / np.float32(a.scale)) + a.zero_point, *s.qrange
    ).astype(np.int64)
    acc = (qa - a.zero_point) @ qw.codes.astype(np.int64)
    m, e = F.quantize_multipliers(
        np.float64(np.float32(a.scale) * qw.scale.astype(np.float32)) / out.scale
    )
    codes = F.ref_requantize(acc, m, e, out.zero_point, *s.qrange)
    want = (codes - out.zero_point).astype(np.float32) * np.float32(out.scale)
    np.testing.assert_array_equal(np.asarray(qf(X)), want)
    sim = Q(layer, calibration=[(X,)], config=cfg, mode="simulate", progress=False)
    assert np.abs(np.asarray(sim(X)) - want).max() <= out.scale * 1.01
    # the multipliers are host numbers: with the weight a param, both modes refuse up front
    # (simulate mode used to accept it, and realize failed only after training)
    for mode in ("simulate", "realize"):
        with pytest.raises(QuantizeError, match=r"fixed_point.*'L/dot_general'.*is a param"):
            Q(layer_of, W1, calibration=[(X,)], config=cfg, mode=mode)


def test_a_layer_with_an_empty_output_stays_float():
    """A convolution whose kernel is taller than its input has no output to requantize (and no
    calibrated output scale): it stays float, said so, instead of asking to calibrate."""
    x = np.ones((1, 4, 4, 4), np.float32)
    k = np.ones((5, 1, 4, 8), np.float32)
    dn = ("NHWC", "HWIO", "NHWC")
    f = lambda v: lax.conv_general_dilated(v, k, (1, 1), "VALID", dimension_numbers=dn)
    qf = Q(f, calibration=[(x,)], config=QConfig(requantize="fixed_point"), progress=False)
    assert np.asarray(qf(x)).shape == (1, 0, 4, 8)
    assert "size-0" in qf.report().layers[0].status


def layer_of(w, v):
    with jax.named_scope("L"):
        return v @ w


# ---- the passes alone ------------------------------------------------------------------------------


def test_passes_compose_and_report():
    prog = jaxq.trace(mlp, X)
    pipeline = jaxq.transform.Sequential(
        [Q.annotate(QConfig()), Q.calibrate([(X,)], progress=False), Q.realize()]
    )
    out = pipeline(prog)
    ref = Q(mlp, calibration=[(X,)], progress=False)
    np.testing.assert_array_equal(np.asarray(out(X)), np.asarray(ref(X)))
    rep = ref.report()
    d = rep.to_dict()
    assert [r["name"] for r in d["layers"]] == [
        "MLP/Dense_0/dot_general",
        "MLP/Dense_1/dot_general",
    ]
    assert d["layers"][0]["activations"] == "int8 asym tensor static" and d["mode"] == "realize"
    assert "MLP/Dense_1/dot_general" in str(rep) and "int8 sym channel narrow" in str(rep)
    annotated = Q.annotate(QConfig())(prog)
    assert "kind=weight" in str(annotated) and "kind=activation" in str(annotated)
    assert str(Q.annotate(QConfig())(annotated)) == str(annotated)  # idempotent
    assert str(Q.realize()(out)) == str(out)  # idempotent: the same integer program


def test_rules_first_match_wins_and_unmatched_are_reported():
    rules = (
        Rule(pattern="Dense_1", skip=True),
        Rule(pattern="Dense", weights=Scheme(bits=4, granularity="channel")),
        Rule(pattern="Nope"),
        Rule(pattern="Dense_0/dot"),  # (a right pattern, every layer taken by rules[1])
    )
    with pytest.warns(UserWarning, match="matched no equation"):
        qf = Q(mlp, calibration=[(X,)], config=QConfig(rules=rules), progress=False)
    rows = {r.name: r for r in qf.report().layers}
    assert rows["MLP/Dense_1/dot_general"].status == "skipped by rules[0]"
    assert rows["MLP/Dense_1/dot_general"].rule == 0
    assert (
        rows["MLP/Dense_0/dot_general"].weights.startswith("int4")
        and rows["MLP/Dense_0/dot_general"].rule == 1
    )
    assert qf.report().unmatched_rules == (
        f"rules[2]: {rules[2]!r}",
        f"rules[3]: {rules[3]!r} (shadowed: an earlier rule takes every layer it matches)",
    )


# ---- bad input --------------------------------------------------------------------------------------


def test_bad_input():
    with pytest.raises(QuantizeError, match="calibration data is empty"):
        Q(mlp, calibration=[], progress=False)
    with pytest.raises(ValueError, match="max_batches must be a positive int; got 0"):
        Q(mlp, calibration=[(X,)], max_batches=0, progress=False)  # (said the data was empty)
    with pytest.raises(QuantizeError, match="calibration batch 1"):
        Q(mlp, calibration=[(X,), (X, X)], progress=False)
    with pytest.raises(QuantizeError, match="need calibration data"):
        Q(mlp, example_args=(X,))
    with pytest.raises(QuantizeError, match="16-bit weights"):
        Q(mlp, calibration=[(X,)], config=QConfig(weights=Scheme(bits=16)), progress=False)
    by_five = (Rule(weights=Scheme(granularity="group", group_size=5)),)
    with pytest.raises(QuantizeError, match=r"rules\[0\]\).*or a group_size that divides 16"):
        Q(mlp, calibration=[(X,)], config=QConfig(rules=by_five), progress=False)
    grouped = Scheme(granularity="group", group_size=2)
    with pytest.raises(QuantizeError, match=r"granularity='group' needs a 2-D weight.*rules\[0\]"):
        Q(cnn, calibration=[(XI,)], config=QConfig(rules=(Rule(weights=grouped),)), progress=False)
    with pytest.raises(ValueError, match="mode must be one of"):
        Q(mlp, calibration=[(X,)], mode="int8")
    with pytest.raises(QuantizeError, match="no quantization state"):
        Q.calibrate([(X,)])(jaxq.trace(mlp, X))
    with pytest.raises(QuantizeError, match="no calibrated activation scale"):
        Q.realize()(Q.annotate(QConfig())(jaxq.trace(mlp, X)))
    with pytest.raises(QuantizeError, match="does not match the program"):
        Q.calibrate([(X[:2],)], progress=False)(Q.annotate(QConfig())(jaxq.trace(mlp, X)))


def test_nan_in_calibration_names_the_layer():
    bad = X.copy()
    bad[2, 3] = np.nan
    with pytest.raises(
        QuantizeError,
        match=r"NaN or Inf in the input of layer 'MLP/Dense_0/dot_general' \(calibration batch 1\)",
    ):
        Q(mlp, calibration=[(X,), (bad,)], progress=False)
    # a NaN in a param reaches the next layer's input: the param is named, not the data
    w = {"w1": (RNG.normal(size=(8, 16))).astype(np.float32), "w2": np.ones((16, 4), np.float32)}
    w["w1"][2, 3] = np.nan
    f = lambda p, x: jax.nn.relu(x @ p["w1"]) @ p["w2"]
    with pytest.raises(QuantizeError, match=r"from the params: \['w1'\] holds NaN or Inf"):
        Q(f, w, calibration=[(X[:, :8],)], progress=False)


def test_an_empty_calibration_batch_adds_nothing():
    """A batch of 0 rows (the tail of a split) crashed calibration inside a reduction."""
    with_empty = Q(mlp, calibration=[(X,), (X[:0],)], progress=False)
    np.testing.assert_array_equal(with_empty(X), Q(mlp, calibration=[(X,)], progress=False)(X))


def test_constant_input_gets_a_valid_scale():
    z = np.zeros_like(X)
    with pytest.warns(UserWarning, match=r"layer 'MLP/Dense_0/dot_general' was 0 everywhere"):
        qf = Q(mlp, calibration=[(z,)], progress=False)
    for a in get_state(qf.program, "t").act.values():
        assert np.isfinite(a.scale) and a.scale > 0
    np.testing.assert_allclose(np.asarray(qf(z)), np.asarray(mlp(z)), atol=0.05)


def test_accumulator_overflow_is_an_error():
    k = 140_000
    w = np.ones((k, 1), np.float32)

    def big(v):
        return v @ w

    x = np.ones((2, k), np.float32)
    with (
        pytest.warns(UserWarning, match="was 1 everywhere"),
        pytest.raises(QuantizeError, match="int32 accumulator .* could overflow"),
    ):
        Q(big, calibration=[(x,)], progress=False)


def _conv_net(x, pool):
    with jax.named_scope("Conv_0"):
        h = lax.conv_general_dilated(
            x, K1, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    h = jax.nn.relu(h)
    if pool:
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = jnp.transpose(h, (0, 3, 1, 2)).reshape(x.shape[0], -1)
    with jax.named_scope("Dense_0"):
        return h @ WC[: h.shape[1]]


@pytest.mark.parametrize("pool", [False, True], ids=["relu", "relu+pool"])
def test_pass_through_ops_stay_in_the_integer_domain(pool):
    from jaxq.quantize._lower import lower
    from jaxq.quantize._realize import realize_handler

    net = functools.partial(_conv_net, pool=pool)
    qf = Q(net, calibration=[(XI,)], progress=False)
    text = str(qf.program)
    for op in ("transpose", "reshape") if pool else ("transpose", "reshape", "max"):
        assert re.search(rf"int8\[[0-9,]+\]\S* = {op}", text), op
    # max pooling stays in float: XLA fuses it with the convolution's epilogue (a 4x smaller
    # tensor is quantized after it)
    assert not re.search(r"int8\[[0-9,]+\]\S* = reduce_window_max", text)
    if pool:  # unless the tuning pools codes (ONNX Runtime's QLinearConv wants them): exact too
        with pinned(dataclasses.replace(ROUTES, pool_codes=True)):
            coded = Q(net, calibration=[(XI,)], progress=False)
            assert re.search(r"int8\[[0-9,]+\]\S* = reduce_window_max", str(coded.specialize(XI)))
            np.testing.assert_array_equal(np.asarray(coded(XI)), np.asarray(qf(XI)))
    state = get_state(qf.program, "t")
    plain, _ = lower(state, realize_handler(state), integer_chains=False)  # quantize at the dot
    assert not re.search(r"int8\[[0-9,]+\]\S* = (transpose|reshape)", str(plain))
    np.testing.assert_array_equal(np.asarray(qf(XI)), np.asarray(plain(XI)))
    sim = Q(net, calibration=[(XI,)], mode="simulate", progress=False)
    np.testing.assert_allclose(np.asarray(qf(XI)), np.asarray(sim(XI)), atol=1e-5)


@pytest.mark.xla_cpu
@pytest.mark.parametrize("pool", [False, True], ids=["relu", "relu+pool"])
def test_a_pooled_convolution_has_its_own_route_to_the_same_integers(pool):
    from jaxq.quantize._realize import pooled_outputs

    net = functools.partial(_conv_net, pool=pool)
    s8 = Tuning(float_carry_max_rows=1, s8_conv_min_channels=1, s8_pooled_conv_min_channels=1)
    pooled_f32 = dataclasses.replace(s8, s8_pooled_conv_min_channels=10**6)
    outs = []
    for tune in (s8, pooled_f32):
        with pinned(tune):
            qf = Q(net, calibration=[(XI,)], progress=False)
            text = str(qf.specialize(XI))
            outs.append(np.asarray(qf(XI)))
        s8_conv = re.search(r"int32\[[0-9,]+\]\S* = conv_general_dilated", text) is not None
        assert s8_conv == (tune is s8 or not pool)
    assert pooled_outputs(get_state(qf.program, "t").source) == (
        {"Conv_0/conv_general_dilated"} if pool else set()
    )
    np.testing.assert_array_equal(outs[0], outs[1])


def test_rule_quantizes_a_bias_add_weights_only():
    # one scale for the bias: a rule's scheme would otherwise take per-channel from the config's
    bias = Scheme(bits=8, granularity="tensor", narrow_range=False)
    rules = (Rule(pattern="Dense_0", primitives={"add"}, weights=bias),)
    r, s = both(mlp, [(X,)], QConfig(rules=rules))
    rows = {row.name: row for row in r.report().layers}
    assert rows["MLP/Dense_0/add"].weights == "int8 sym tensor"
    assert rows["MLP/Dense_0/add"].activations is None
    assert "MLP/Dense_1/add" not in rows  # elementwise ops are opt-in, and unreported otherwise
    np.testing.assert_allclose(np.asarray(r(X)), np.asarray(s(X)), atol=1e-5)
    plain = Q(mlp, calibration=[(X,)], progress=False)
    assert r.report().param_bytes < plain.report().param_bytes  # the f32 bias became int8


@pytest.mark.filterwarnings("ignore:jaxq.quantize.*inside scan:UserWarning")
@settings(max_examples=examples(5))
@given(programs(max_ops=6))
def test_random_programs_quantize_in_both_modes(rp):
    """Nested jit / scan / cond / while / remat / custom_jvp: quantization never breaks a program;
    dots and convolutions it cannot reach stay float and are reported."""
    cal = [rp.args]
    cfg = QConfig(dynamic=True)  # activation sites inside loops cannot be calibrated anyway
    r = Q(rp.fun, calibration=cal, config=cfg, progress=False)
    s = Q(rp.fun, calibration=cal, config=cfg, mode="simulate", progress=False)
    ref = jax.tree.leaves(rp.fun(*rp.args))
    for a, b, c in zip(
        jax.tree.leaves(r(*rp.args)), jax.tree.leaves(s(*rp.args)), ref, strict=True
    ):
        assert a.shape == c.shape and a.dtype == c.dtype
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-3 * (1 + np.abs(np.asarray(b)).max())
        )
    str(r.report())


def test_control_flow_bodies_are_left_float_and_reported():
    def f(x):
        def body(h, _):
            return jax.nn.relu(h @ W1[:, :16]), None

        h, _ = lax.scan(body, x, None, length=2)
        h = lax.cond(h.sum() > 0, lambda v: v @ W1, lambda v: -v @ W1, h)
        with jax.named_scope("Out"):
            return h @ W2

    with pytest.warns(UserWarning, match=r"3 layer\(s\) inside scan / while / cond bodies stay"):
        qf = Q(f, calibration=[(X,)], progress=False)
    rows = {r.name: r for r in qf.report().layers}
    assert rows["Out/dot_general"].status == "quantized"
    loops = [r for r in rows.values() if r.status != "quantized"]
    assert loops and all(r.status.startswith("inside a scan / while / cond body") for r in loops)
    np.testing.assert_allclose(np.asarray(qf(X)), np.asarray(f(X)), atol=0.05 * np.abs(f(X)).max())


ROUNDINGS = ("nearest_even", "half_away_from_zero", "half_up", "floor")
SCHEME_KINDS = list(itertools.product((8, 4), (True, False), (True, False)))  # bits, signed, sym
# A pairwise covering design: every (scheme, granularity), (scheme, rounding) and (granularity,
# rounding) pair occurs (rounding = (i + j) mod 4), in 32 runs instead of 128.
COMBOS = [
    (*kind, gran, ROUNDINGS[(i + j) % 4])
    for i, kind in enumerate(SCHEME_KINDS)
    for j, gran in enumerate(("tensor", "channel", "group", "token"))
]


def test_every_scheme_granularity_rounding_pair():
    """Realized and simulated from one traced program (dynamic activation scales, so no
    calibration is needed); each agrees with the other and, where the scheme can represent
    negative values, with the float result."""
    w = (RNG.normal(size=(8, 4)) * 0.5).astype(np.float32)

    def layer(v):
        with jax.named_scope("L"):
            return v @ w

    x = X[:3, :8]
    prog = jaxq.trace(layer, x)
    ref = np.asarray(layer(x))
    assert {c[3:] for c in COMBOS} == set(
        itertools.product(("tensor", "channel", "group", "token"), ROUNDINGS)
    )
    for bits, signed, sym, gran, rnd in COMBOS:
        base = dict(bits=bits, signed=signed, symmetric=sym, rounding=rnd)
        wg = {"token": "channel"}.get(gran, gran)
        ws = Scheme(**base, granularity=wg, group_size=4 if wg == "group" else None)
        acts = Scheme(**base, granularity="token" if gran == "token" else "tensor")
        annotated = Q.annotate(QConfig(weights=ws, activations=acts, dynamic=True))(prog)
        out_r = np.asarray(Q.realize()(annotated)(x))
        out_s = np.asarray(annotated(x))
        label = str((bits, signed, sym, gran, rnd))
        np.testing.assert_allclose(out_r, out_s, atol=1e-5, err_msg=label)
        if signed or not sym:  # unsigned symmetric codes clip every negative value to 0
            tol = (0.6 if bits == 4 else 0.1) * np.abs(ref).max()
            assert np.abs(out_r - ref).max() < tol, label


def test_package_is_callable_and_exports_the_passes():
    qf = Q(mlp, config=QConfig(dynamic=True), example_args=(X,), progress=False)
    assert isinstance(qf, Q.QuantizedFunction) and qf.mode == "realize"
    for name in ("annotate", "calibrate", "realize", "QArray", "QConfig", "Scheme", "Rule"):
        assert hasattr(Q, name)
    assert isinstance(Q.annotate(), jaxq.transform.Pass)


WB = (RNG.normal(size=(2, 8, 5)) * 0.4).astype(np.float32)  # batched weight [B, K, N]
KD = (RNG.normal(size=(3, 3, 1, 4)) * 0.4).astype(np.float32)  # depthwise HWIO (I = C / groups)
KT = (RNG.normal(size=(2, 2, 4, 3)) * 0.4).astype(np.float32)


def _geometries():
    def weight_on_the_left(x):  # W @ x: the weight is dot_general's lhs
        return (W1.T @ x.T).T

    def batched(x):  # einsum with a batch dim on both operands
        return jnp.einsum("bmk,bkn->bmn", x.reshape(2, 3, 8), WB)

    def depthwise_strided(x):
        return lax.conv_general_dilated(
            x,
            KD,
            (2, 2),
            ((1, 0), (0, 1)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=4,
        )

    def transposed_dilated(x):  # lhs dilation (a transposed convolution) and rhs dilation
        return lax.conv_general_dilated(
            x,
            KT,
            (1, 1),
            ((1, 1), (1, 1)),
            lhs_dilation=(2, 2),
            rhs_dilation=(1, 2),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )

    xi4 = RNG.normal(size=(2, 5, 5, 4)).astype(np.float32)
    return [
        (weight_on_the_left, X),
        (batched, X[:, :8]),
        (depthwise_strided, xi4),
        (transposed_dilated, xi4),
    ]


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("asym_weights", [False, True])
def test_dimension_numbers_and_conv_variants(case, asym_weights):
    f, x = _geometries()[case]
    cfg = QConfig(
        weights=Scheme(granularity="channel", symmetric=not asym_weights),
        activations=Scheme(symmetric=False),  # a zero point on both sides: every correction term
    )
    r, s = both(f, [(x,)], cfg)
    assert len(get_state(r.program, "t").sites) == 1
    ref = np.asarray(f(x))
    out_r, out_s = np.asarray(r(x)), np.asarray(s(x))
    np.testing.assert_allclose(out_r, out_s, atol=1e-5 * max(1.0, np.abs(ref).max()))
    assert np.abs(out_r - ref).max() < 0.05 * np.abs(ref).max()


@settings(max_examples=examples(8), deadline=None)
@given(
    st.sampled_from([("NHWC", "HWIO", "NHWC"), ("NCHW", "OIHW", "NCHW"), ("NHWC", "OIHW", "NCHW")]),
    st.tuples(st.integers(1, 3), st.integers(1, 2)),  # kernel size
    st.tuples(st.integers(1, 2), st.integers(1, 2)),  # strides
    st.tuples(st.integers(1, 2), st.integers(1, 2)),  # rhs dilation
    st.sampled_from(["SAME", "VALID", ((1, 0), (0, 2))]),
    st.sampled_from([1, 3]),  # feature groups
    st.booleans(),  # asymmetric activations (zero-point and border terms)
    st.booleans(),  # asymmetric weights
    st.integers(0, 2**16),
)
def test_convolutions_in_any_layout(dn, ksize, strides, rdil, pad, groups, asym, wasym, seed):
    # channels-last runs the s8 kernel (18 output channels: wide enough); other layouts, and
    # convolutions with few products per output (a sum of shifted slices), carry exact integer
    # sums in f32
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 7, 6, 3)).astype(np.float32)  # NHWC
    w = (rng.normal(size=(*ksize, 3 // groups, 18)) * 0.4).astype(np.float32)  # HWIO
    x = np.transpose(x, ["NHWC".index(c) for c in dn[0]])
    w = np.transpose(w, ["HWIO".index(c) for c in dn[1]])

    def f(v):
        with jax.named_scope("C"):
            return lax.conv_general_dilated(
                v, w, strides, pad, rhs_dilation=rdil, dimension_numbers=dn,
                feature_group_count=groups,
            )  # fmt: skip

    cfg = QConfig(
        weights=Scheme(granularity="channel", symmetric=not wasym),
        activations=Scheme(symmetric=not asym),
    )
    with pinned():
        r, s = both(f, [(x,)], cfg)
    out_r, out_s = np.asarray(r(x)), np.asarray(s(x))
    np.testing.assert_allclose(out_r, out_s, atol=1e-5 * max(1.0, np.abs(out_s).max()))
    text = str(r.program)
    assert "int8" in text
    by_taps = groups == 1 and ksize[0] * ksize[1] * 3 <= ROUTES.conv_taps_max
    channels_last = dn[0] == "NHWC" and dn[1] == "HWIO"
    assert ("preferred_element_type=int32" in text) == (channels_last and not by_taps)


@pytest.mark.parametrize("channels", [1, 2])  # 9 products per output (by taps), 18 (a kernel)
@pytest.mark.parametrize("dn", [("NHWC", "HWIO", "NHWC"), ("NCHW", "OIHW", "NCHW")])
def test_few_input_channels_run_as_shifted_slices(channels, dn):
    rng = np.random.default_rng(channels)
    x = rng.normal(size=(3, 9, 8, channels)).astype(np.float32)
    w = (rng.normal(size=(3, 3, channels, 5)) * 0.4).astype(np.float32)
    x = np.transpose(x, ["NHWC".index(c) for c in dn[0]])
    w = np.transpose(w, ["HWIO".index(c) for c in dn[1]])

    def f(v):
        with jax.named_scope("C"):
            return lax.conv_general_dilated(v, w, (2, 1), ((1, 1), (2, 0)), dimension_numbers=dn)

    cfg = QConfig(activations=Scheme(symmetric=False), weights=Scheme(granularity="channel"))
    with pinned():
        r, s = both(f, [(x,)], cfg)
    np.testing.assert_allclose(np.asarray(r(x)), np.asarray(s(x)), atol=1e-5 * np.abs(f(x)).max())
    text = str(r.program)
    by_taps = 9 * channels <= ROUTES.conv_taps_max
    assert ("= conv_general_dilated[" not in text) == by_taps
    assert (
        "preferred_element_type=int32" not in text
    )  # 5 output channels: too few for the s8 kernel


@pytest.mark.parametrize("pad", ["SAME", ((1, 0), (0, 2))])
@pytest.mark.parametrize("wasym", [False, True])
def test_s8_convolution_with_zero_point_borders(pad, wasym):
    # wide enough for the s8 kernel: padded positions hold code 0, the zero-point terms of the
    # real positions come from convolutions of a mask
    rng = np.random.default_rng(7)
    x = rng.normal(size=(2, 7, 6, 4)).astype(np.float32)
    w = (rng.normal(size=(3, 3, 4, 20)) * 0.3).astype(np.float32)

    def f(v):
        with jax.named_scope("C"):
            dn = ("NHWC", "HWIO", "NHWC")
            return lax.conv_general_dilated(v, w, (1, 2), pad, dimension_numbers=dn)

    cfg = QConfig(
        weights=Scheme(granularity="channel", symmetric=not wasym),
        activations=Scheme(symmetric=False),
    )
    with pinned():
        r, s = both(f, [(x,)], cfg)
    np.testing.assert_allclose(np.asarray(r(x)), np.asarray(s(x)), atol=1e-5 * np.abs(f(x)).max())
    assert "preferred_element_type=int32" in str(r.program)


@pytest.mark.parametrize("layout", ["transposed", "NCHW"])
def test_convolutions_xla_runs_slowly_in_s8_carry_their_sums_in_f32_chunks(layout):
    """A transposed convolution (input dilation: nn.ConvTranspose) and an NCHW one whose sums pass
    f32's exact range ran XLA:CPU's s8 convolution, 10-25x slower than float (helper: 144 ms
    against 7 ms); their sums are carried in f32 chunks, added in int32, as on a GPU."""
    rng = np.random.default_rng(21)
    c = 64  # (9 taps x 64 channels x 255 x 127 > 2**24: not exact in one f32 sum)
    if layout == "NCHW":  # (centered activation codes reach 128: twice the channels)
        c = 128
        dn, x, w = (
            ("NCHW", "OIHW", "NCHW"),
            rng.normal(size=(2, c, 6, 6)),
            rng.choice([-1.0, 1.0], size=(8, c, 3, 3)),  # (every code at 127)
        )
        f = lambda x: lax.conv_general_dilated(x, w * 0.1, (1, 1), "SAME", dimension_numbers=dn)
    else:
        dn, x, w = (
            ("NHWC", "HWIO", "NHWC"),
            rng.normal(size=(2, 6, 6, c)),
            rng.normal(size=(3, 3, c, 24)),
        )
        f = lambda x: lax.conv_general_dilated(  # noqa: E731
            x, w * 0.1, (1, 1), ((2, 2), (2, 2)), lhs_dilation=(2, 2), dimension_numbers=dn
        )
    x = x.astype(np.float32)
    cfg = QConfig(activations=Scheme(symmetric=False))
    with pinned():
        r, s = both(f, [(x,)], cfg)
        program = str(r.specialize(x))
    assert "preferred_element_type=int32" not in program and "conv_general_dilated" in program
    np.testing.assert_allclose(np.asarray(r(x)), np.asarray(s(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.xla_cpu
@settings(max_examples=examples(6), deadline=None)
@given(
    st.tuples(st.integers(1, 3), st.integers(1, 3)),  # kernel
    st.tuples(st.integers(1, 2), st.integers(1, 2)),  # strides
    st.tuples(st.integers(1, 2), st.integers(1, 2)),  # dilation
    st.sampled_from(["SAME", "VALID", ((1, 0), (2, -1))]),
    st.integers(1, 5),  # input channels
    st.booleans(),  # asymmetric weights
    st.booleans(),  # the kernel a param (else closed over: zero-point borders by mask)
    st.integers(0, 2**16),
)
def test_im2col_convolutions_give_the_s8_convolutions_integers(
    kernel, strides, dilation, pad, c, wasym, as_param, seed
):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 7, 6, c)).astype(np.float32)
    w = (rng.normal(size=(*kernel, c, 3)) * 0.3).astype(np.float32)
    dn = ("NHWC", "HWIO", "NHWC")

    def f(p, v):
        return lax.conv_general_dilated(
            v, p, strides, pad, rhs_dilation=dilation, dimension_numbers=dn
        )

    cfg = QConfig(
        weights=Scheme(granularity="channel", symmetric=not wasym),
        activations=Scheme(symmetric=False),
    )
    outs, texts = [], []
    for tuning in (ROUTES, IM2COL):  # (every convolution in s8: no f32 sums, no taps)
        tuning = dataclasses.replace(tuning, s8_conv_min_channels=1, conv_taps_max=0)
        with pinned(tuning):
            qf = (
                Q(f, w, calibration=[(x,)], config=cfg, progress=False)
                if as_param
                else Q(functools.partial(f, w), calibration=[(x,)], config=cfg, progress=False)
            )
            outs.append(np.asarray(qf(x)))
            texts.append(str(qf.specialize(x)))
    assert "= dot_general[" in texts[1] and "= dot_general[" not in texts[0]  # (the routes)
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.xla_cpu
@pytest.mark.parametrize("tuning", [ROUTES, IM2COL], ids=["conv", "im2col"])
def test_an_s8_convolution_after_a_requantize_keeps_int8_operands_when_compiled(tuning):
    # realize's codes clamp through jnp.clip: with inline literal bounds XLA:CPU proved the
    # codes' range and compiled the next convolution as s32 x s32, off its int8 kernel (10x
    # slower: bench_quantize's CNN, weights closed over)
    rng = np.random.default_rng(8)
    k0 = (rng.normal(size=(3, 3, 1, 32)) * 0.5).astype(np.float32)
    b0 = (rng.normal(size=(32,)) * 0.1).astype(np.float32)
    k1 = (rng.normal(size=(3, 3, 32, 64)) * 0.1).astype(np.float32)
    dn = ("NHWC", "HWIO", "NHWC")

    def f(x):
        with jax.named_scope("C0"):
            y = lax.conv_general_dilated(x, k0, (1, 1), "SAME", dimension_numbers=dn)
            x = jax.nn.relu(y + b0)
        with jax.named_scope("C1"):
            return lax.conv_general_dilated(x, k1, (1, 1), "SAME", dimension_numbers=dn)

    x = rng.random((64, 8, 8, 1)).astype(np.float32)
    with pinned(tuning):
        qf = Q(f, calibration=[(x,)], progress=False)
        assert "preferred_element_type=int32" in str(qf.program)
        hlo = jax.jit(qf).lower(x).compile().as_text()
    w = "3,3,32,64" if tuning is ROUTES else "288,64"  # (im2col: [window x C, O])
    assert f"s8[{w}]" in hlo and f"s32[{w}]" not in hlo  # (the weights stay int8)
