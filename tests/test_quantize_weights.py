"""How weight codes are chosen: minmax, MSE clipping and GPTQ (QConfig.weight_calibration)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import examples
from test_quantize_pipeline import reference_dense

import jaxq
import jaxq.quantize as Q
from jaxq.quantize import QConfig, QuantizeError, Scheme
from jaxq.quantize._gptq import gptq_codes
from jaxq.quantize._state import get_state


def correlated(rng, rows, k):
    """Activations with strongly correlated columns (what makes GPTQ's compensation pay)."""
    base = rng.normal(size=(rows, k // 4))
    return (np.repeat(base, 4, axis=1) + 0.1 * rng.normal(size=(rows, k))).astype(np.float32)


def rtn(w, s, qmin=-127, qmax=127):
    return np.clip(np.rint(w / s), qmin, qmax)


@settings(max_examples=examples(10), deadline=None)
@given(st.integers(0, 2**16), st.sampled_from([(16, 5), (130, 3)]))
def test_gptq_on_independent_inputs_is_round_to_nearest(seed, shape):
    # a diagonal second moment couples no rows: nothing to compensate
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape)
    s = np.abs(w).max(0, keepdims=True) / 127
    gram = np.diag(rng.uniform(0.1, 2.0, shape[0]))
    np.testing.assert_array_equal(gptq_codes(w, s, 0.0, (-127, 127), gram, 0.1), rtn(w, s))


@settings(max_examples=examples(10), deadline=None)
@given(st.integers(0, 2**16), st.sampled_from([4, 3]))
def test_gptq_lowers_output_error_on_its_data(seed, bits):
    rng = np.random.default_rng(seed)
    x = correlated(rng, 256, 160)  # 160 > BLOCK: the lazy block update runs too
    w = rng.normal(size=(160, 6))
    qmax = 2 ** (bits - 1) - 1
    s = np.abs(w).max(0, keepdims=True) / qmax
    q = gptq_codes(w, s, 0.0, (-qmax, qmax), x.T.astype(np.float64) @ x, 0.01)
    assert q.min() >= -qmax and q.max() <= qmax and np.all(q == np.rint(q))
    err = lambda codes: np.sum((x @ w - x @ (codes * s)) ** 2)
    assert err(q) < 0.8 * err(rtn(w, s, -qmax, qmax))


def dense(w):
    def layer(v):
        with jax.named_scope("L"):
            return v @ w

    return layer


@pytest.mark.parametrize("activations", [None, Scheme(symmetric=False)])
def test_gptq_end_to_end(activations):
    rng = np.random.default_rng(1)
    w = rng.normal(size=(32, 8)).astype(np.float32)
    calib = [(correlated(rng, 64, 32),) for _ in range(3)]
    x = np.concatenate([c[0] for c in calib])
    weights = Scheme(bits=4, granularity="channel")
    out = {}
    for method in ("minmax", "gptq"):
        cfg = QConfig(weights=weights, activations=activations, weight_calibration=method)
        r = Q(dense(w), calibration=calib, config=cfg, progress=False)
        s = Q(dense(w), calibration=calib, config=cfg, mode="simulate", progress=False)
        out[method] = np.asarray(r(x))
        np.testing.assert_allclose(out[method], np.asarray(s(x)), rtol=1e-5, atol=1e-5)
        state = get_state(r.program, "test")
        assert state.weights["L/dot_general"].method == method
        assert method in str(r.report()) or method == "minmax"
        if activations is not None:  # the integer code is exact against the simulated operands
            want = reference_dense(x, state, "L/dot_general", w)
            np.testing.assert_array_equal(np.asarray(r(x)), want)
    ref = x @ w
    assert np.sum((out["gptq"] - ref) ** 2) < np.sum((out["minmax"] - ref) ** 2)


@pytest.mark.parametrize("dn", [("NHWC", "HWIO", "NHWC"), ("NCHW", "OIHW", "NCHW")])
def test_gptq_convolutions(dn):
    # the kernel's contracted axes (window, input channel) in any layout match the patch moments
    rng = np.random.default_rng(2)
    base = rng.normal(size=(8, 6, 6, 1))
    x = (np.repeat(base, 4, axis=-1) + 0.1 * rng.normal(size=(8, 6, 6, 4))).astype(np.float32)
    w = rng.normal(size=(3, 3, 4, 5)).astype(np.float32)
    x = np.transpose(x, ["NHWC".index(c) for c in dn[0]])
    w = np.transpose(w, ["HWIO".index(c) for c in dn[1]])

    def conv(v, groups=1):
        with jax.named_scope("C"):
            return jax.lax.conv_general_dilated(
                v, w, (1, 2), "SAME", dimension_numbers=dn, feature_group_count=groups
            )

    ref = np.asarray(conv(x))
    err = {}
    for method in ("minmax", "gptq"):
        cfg = QConfig(
            weights=Scheme(bits=4, granularity="channel"),
            activations=None,
            weight_calibration=method,
        )
        r = Q(conv, calibration=[(x,)], config=cfg, progress=False)
        s = Q(conv, calibration=[(x,)], config=cfg, mode="simulate", progress=False)
        np.testing.assert_allclose(np.asarray(r(x)), np.asarray(s(x)), rtol=1e-5, atol=1e-4)
        assert get_state(r.program, "t").weights["C/conv_general_dilated"].method == method
        err[method] = np.sum((np.asarray(r(x)) - ref) ** 2)
    assert err["gptq"] < 0.8 * err["minmax"]
    # a grouped (depthwise) convolution keeps minmax codes
    w = w[..., :1, :4] if dn[1] == "HWIO" else w[:4, :1]
    cfg = QConfig(activations=None, weight_calibration="gptq")
    qf = Q(lambda v: conv(v, groups=4), calibration=[(x,)], config=cfg, progress=False)
    assert get_state(qf.program, "t").weights["C/conv_general_dilated"].method == "minmax"


def test_gptq_needs_calibration():
    cfg = QConfig(activations=None, weight_calibration="gptq")
    w = np.ones((4, 2), np.float32)
    with pytest.raises(QuantizeError, match="weight_calibration='gptq'"):
        Q(dense(w), config=cfg, example_args=(np.ones((1, 4), np.float32),))
    import jaxq

    program = Q.annotate(cfg)(jaxq.trace(dense(w), np.ones((1, 4), np.float32)))
    with pytest.raises(QuantizeError, match="run jaxq.quantize.calibrate"):
        Q.realize()(program)


@settings(max_examples=examples(10), deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(["tensor", "channel"]), st.booleans())
def test_mse_clipping_never_worse_than_minmax(seed, gran, symmetric):
    rng = np.random.default_rng(seed)
    w = rng.standard_t(3, size=(48, 6)).astype(np.float32)  # heavy tails: clipping pays
    weights = Scheme(bits=4, granularity=gran, symmetric=symmetric)
    err = {}
    for method in ("minmax", "mse"):
        cfg = QConfig(weights=weights, activations=None, weight_calibration=method)
        qf = Q(dense(w), config=cfg, example_args=(np.eye(48, dtype=np.float32),))
        err[method] = np.sum((np.asarray(qf(np.eye(48, dtype=np.float32))) - w) ** 2)
    assert err["mse"] <= err["minmax"] * (1 + 1e-6)


def test_weight_calibration_validation():
    with pytest.raises(ValueError, match="weight_calibration must be one of"):
        QConfig(weight_calibration="hqq")
    with pytest.raises(ValueError, match="choose one"):
        QConfig(weight_calibration="awq", smoothing=0.5)
    with pytest.raises(ValueError, match="gptq_damp"):
        QConfig(gptq_damp=0)
    with pytest.raises(TypeError, match="gptq_damp"):
        QConfig(gptq_damp="big")


@pytest.mark.parametrize(
    "config, closed",
    [(QConfig(), False), (QConfig(), True), (QConfig(requantize="fixed_point"), True)],
)
def test_weights_on_the_left_realize_like_weights_on_the_right(config, closed):
    # (Equinox's Linear: w @ x per example, under vmap dot_general(w, x) then a transpose.
    # realize runs it as x @ w, XLA:CPU's fast int8 orientation, with the same integers and
    # floats as the layer written x @ w.T, NaN rows included; no bias, which XLA may or may not
    # contract with the rescale into one FMA depending on the layout around it)
    rng = np.random.default_rng(3)
    params = {"w": rng.normal(size=(8, 16)).astype(np.float32)}
    left = lambda p, x: jax.nn.relu(jax.vmap(lambda r: p["w"] @ r)(x))
    right = lambda p, x: jax.nn.relu(x @ p["w"].T)
    x = rng.normal(size=(5, 16)).astype(np.float32)
    x[2, 3] = np.nan
    qs = [
        jaxq.quantize(functools.partial(f, params), calibration=[(x[:2],)], config=config)
        if closed
        else jaxq.quantize(f, params, calibration=[(x[:2],)], config=config)
        for f in (left, right)
    ]
    ys = [np.asarray(jax.jit(q)(x)) for q in qs]
    # (bit-equal on AVX-512 machines; XLA:CPU's AVX2 code rounds the fixed-point rescale of one
    # orientation an ulp apart)
    np.testing.assert_allclose(ys[0], ys[1], rtol=3e-7, atol=0)
    assert np.isnan(ys[0][2]).all() and not np.isnan(ys[0][[0, 1, 3, 4]]).any()
    dots = [e for e in qs[0].program.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [d.invars[1].aval.shape for d in dots] == [(8, 16)]  # (the weight codes on the right)


@pytest.mark.parametrize("activations", [None, Scheme()])
@pytest.mark.parametrize("closed", [False, True])
def test_unsigned_symmetric_weights_realize_like_simulate(activations, closed):
    """Unsigned codes are stored shifted by -128 into int8, so their zero point is not 0 even for
    a symmetric scheme: the QArray keeps it (it was dropped, and realize ran on codes 128 too
    small: relative error 0.74 against simulate's 0.002). Negative weights, which such a scheme
    clips to 0, are warned about."""
    rng = np.random.default_rng(5)
    params = {"w": np.abs(rng.normal(size=(16, 8))).astype(np.float32)}
    f = lambda p, x: jax.nn.relu(x) @ p["w"]
    x = rng.normal(size=(6, 16)).astype(np.float32)
    cfg = QConfig(weights=Scheme(signed=False, symmetric=True), activations=activations)
    kw = dict(calibration=[(x,)], config=cfg, progress=False)
    q = lambda mode: (
        jaxq.quantize(functools.partial(f, params), mode=mode, **kw)
        if closed
        else jaxq.quantize(f, params, mode=mode, **kw)
    )
    real, sim = q("realize"), q("simulate")
    np.testing.assert_allclose(real(x), sim(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(real(x), f(params, x), rtol=0.05, atol=0.05)
    if not closed:
        np.testing.assert_allclose(real.params["w"].dequantize(), params["w"], atol=0.01)
    negative = {"w": params["w"] - 0.5}
    with pytest.warns(UserWarning, match="holds negative values, which an unsigned"):
        jaxq.quantize(f, negative, **kw)


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_weight_too_small_for_a_normal_scale_keeps_its_codes(symmetric):
    """max|w| / 127 below float32's least normal number flushed to 0 on XLA:CPU, and the scale
    became 1.0: every code 0, the layer's output 0, silently. It takes the least normal scale."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 8)).astype(np.float32)
    p = {
        "w1": rng.normal(size=(8, 16)).astype(np.float32),
        "w2": (rng.normal(size=(16, 4)) * 1e-37).astype(np.float32),
    }
    f = lambda p, x: (x @ p["w1"] * 1e37) @ p["w2"]
    cfg = QConfig(weights=Scheme(granularity="channel", symmetric=symmetric))
    qf = jaxq.quantize(f, p, calibration=[(x,)], config=cfg, progress=False)
    assert np.count_nonzero(np.asarray(qf.params["w2"].codes)) > 50
    want = np.asarray(f(p, x))
    got = np.asarray(qf(x))
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
    closed = jaxq.quantize(functools.partial(f, p), calibration=[(x,)], config=cfg, progress=False)
    np.testing.assert_array_equal(np.asarray(closed(x)), got)


@pytest.mark.parametrize("method", ["minmax", "mse"])
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_a_params_scales_agree_on_the_host_eagerly_and_compiled(method, granularity):
    """QAT computes a param's scales in the program, realize on the host: both, and an eager
    call, give the same fake-quantized weight. XLA compiles ``max|w| / 7`` as ``max|w| * (1/7)``,
    which an eager division of a scalar rounded otherwise (per-tensor scales, MSE's search)."""
    rng = np.random.default_rng(3)
    w = (rng.normal(size=(16, 24)) * rng.uniform(0.01, 10, size=(1, 24))).astype(np.float32)
    w[:, 0] = np.linspace(-0.5, 0.5, 16)
    w[0, 0] = 0.6441282  # (its channel's max)
    p = {"w": w}
    eye = np.eye(16, dtype=np.float32)
    f = lambda p, x: x @ p["w"]  # (x = I: the output is the weight the program uses)
    cfg = QConfig(
        weights=Scheme(bits=4, granularity=granularity),
        activations=None,
        weight_calibration=method,
    )
    qs = jaxq.quantize(f, p, example_args=(eye,), config=cfg, mode="simulate", progress=False)
    qf = jaxq.quantize(f, p, example_args=(eye,), config=cfg, progress=False)
    compiled = np.asarray(jax.jit(qs.apply)(p, eye))
    np.testing.assert_array_equal(np.asarray(qs.apply(p, eye)), compiled)
    np.testing.assert_array_equal(np.asarray(qf.params["w"].dequantize()), compiled)


@pytest.mark.parametrize("granularity", ["channel", "group"])
def test_quantize_compiles_two_programs_per_weight_shape(granularity):
    """A process's first jaxq.quantize spent most of its time compiling: every operation that ran
    eagerly on a new weight shape (copies to the device, a constant's reshape, a moveaxis) and
    the dozen of an activation's scale were compiled one by one: 47 compiles for a 4-layer CNN,
    11 now. Per weight shape: its scales and its fake-quantized value, one program each."""
    import logging

    rng = np.random.default_rng(5)
    f = lambda p, x: jnp.tanh(x @ p["w0"]) @ p["w1"]  # noqa: E731
    w = Scheme(bits=4, granularity="group", group_size=32) if granularity == "group" else Scheme()
    cfg = QConfig(weights=w)

    def model(hidden, out):  # (shapes no other test compiles for)
        p = {"w0": rng.normal(size=(64, hidden)), "w1": rng.normal(size=(hidden, out))}
        return {k: v.astype(np.float32) for k, v in p.items()}

    x = rng.normal(size=(5, 64)).astype(np.float32)
    jaxq.quantize(f, model(96, 7), calibration=[(x,)], config=cfg, progress=False)  # (shared)
    compiled: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Finished XLA compilation"):
                compiled.append(record.getMessage())

    handler, logger = Count(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            jaxq.quantize(f, model(160, 9), calibration=[(x,)], config=cfg, progress=False)
    finally:
        logger.removeHandler(handler)
    assert len(compiled) <= 1 + 2 * 2, compiled  # (calibration; two per weight shape)


@pytest.mark.parametrize(
    "config",
    [
        QConfig(activations=None),
        QConfig(weights=Scheme(bits=4, granularity="channel"), activations=None),
        QConfig(weights=Scheme(bits=4, granularity="channel")),
    ],
    ids=["w8", "w4", "w4a8"],
)
def test_each_layer_converts_its_weight_in_turn(config):
    """A layer's weight is unpacked or converted for its own dot, after the layer before it ran:
    XLA had hoisted every conversion to the start, holding a float copy of all the weights (a
    weight-only model's temporaries were its float weights' size, and ran 2-6x slower)."""
    if not _orders_by_barrier():
        pytest.skip("this XLA (jax 0.10.2's) drops optimization barriers before scheduling")
    rng = np.random.default_rng(13)
    params = [rng.normal(size=(256, 256)).astype(np.float32) / 16 for _ in range(6)]

    def mlp(params, x):
        for w in params:
            x = jnp.tanh(x @ w)
        return x

    x = rng.normal(size=(1, 256)).astype(np.float32)
    qf = jaxq.quantize(mlp, params, calibration=[(x,)], config=config, progress=False)
    compiled = jax.jit(qf.apply).lower(qf.params, x).compile()
    one_layer = params[0].nbytes  # (the float weights: six times this)
    assert compiled.memory_analysis().temp_size_in_bytes <= 1.5 * one_layer
    np.testing.assert_allclose(np.asarray(compiled(qf.params, x)), np.asarray(qf(x)), rtol=1e-6)


def _orders_by_barrier() -> bool:
    """Whether XLA schedules a conversion after the ``optimization_barrier`` it waits on."""

    def f(ws, x):
        for w in ws:
            x, w = jax.lax.optimization_barrier((x, w))
            x = jnp.tanh(x @ w.astype(jnp.float32))
        return x

    ws = [jnp.zeros((256, 256), jnp.int8)] * 4
    compiled = jax.jit(f).lower(ws, jnp.zeros((1, 256))).compile()
    return compiled.memory_analysis().temp_size_in_bytes < 2 * 256 * 256 * 4


# ---- weights with several matrices along a dot's batch axes (MoE experts, vmap) ----------------

E, D, F, T = 3, 8, 16, 6


def expert_params(seed=0):
    rng = np.random.default_rng(seed)
    mags = np.array([0.01, 1.0, 30.0], np.float32)[:, None, None]  # experts far apart in range
    return {
        "w1": jnp.asarray(rng.normal(size=(E, D, F)) * 0.3, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(E, F, D)) * mags, jnp.float32),
    }


def moe_rhs(p, x):
    h = jnp.tanh(jnp.einsum("etd,edf->etf", x, p["w1"]))
    return jnp.einsum("etf,efd->etd", h, p["w2"])


def moe_lhs(p, x):  # the weights on the left: outputs [experts, features, tokens]
    h = jnp.tanh(jnp.einsum("edf,etd->eft", p["w1"], x))
    return jnp.einsum("efd,eft->edt", p["w2"], h).transpose(0, 2, 1)


def moe_vmap(p, x):  # an ensemble: one MLP per leading index, vmapped
    return jax.vmap(lambda q, v: jnp.tanh(v @ q["w1"]) @ q["w2"])(p, x)


def moe_shared(p, x):  # every expert reads the same tokens: the experts are an output axis
    h = jnp.tanh(jnp.einsum("td,edf->etf", x[0], p["w1"]))
    return jnp.einsum("etf,efd->etd", h, p["w2"])


def moe_middle(p, x):  # the experts axis in the middle of the stored weight
    w2 = jnp.transpose(p["w2"], (1, 0, 2))  # [F, E, D]
    h = jnp.tanh(jnp.einsum("etd,edf->etf", x, p["w1"]))
    return jnp.einsum("etf,fed->etd", h, w2)


@pytest.mark.parametrize("f", [moe_rhs, moe_lhs, moe_vmap, moe_shared, moe_middle])
@pytest.mark.parametrize(
    "mode, config",
    [
        ("realize", QConfig()),
        ("realize", QConfig(activations=None)),
        ("simulate", QConfig()),
    ],
)
def test_each_matrix_of_a_batched_weight_gets_its_own_scales(f, mode, config):
    # one scale per channel shared by the experts quantized the small expert's weights to 0
    # (every output of expert 0 was 0: relative error 1.0)
    params = expert_params()
    x = jnp.asarray(np.random.default_rng(1).normal(size=(E, T, D)), jnp.float32)
    qf = jaxq.quantize(f, params, calibration=[(x,)], config=config, mode=mode)
    ref, y = f(params, x), jax.jit(qf.apply)(qf.params if mode == "realize" else params, x)
    for e in range(E):
        err = float(jnp.abs(y[e] - ref[e]).max() / jnp.abs(ref[e]).max())
        assert err < 0.05, (e, err)
    if mode == "realize":
        assert np.shape(qf.params["w1"].scale) == (E, 1, F)


def test_batched_weights_closed_over_and_stacked_in_a_scan():
    params = expert_params()
    x = jnp.asarray(np.random.default_rng(1).normal(size=(E, T, D)), jnp.float32)
    qc = jaxq.quantize(functools.partial(moe_rhs, params), calibration=[(x,)])
    ref = moe_rhs(params, x)
    for e in range(E):
        assert float(jnp.abs(qc(x)[e] - ref[e]).max() / jnp.abs(ref[e]).max()) < 0.05
    # a scan over 2 layers of experts, int4: each layer's experts quantized as the layer alone
    stacked = jax.tree.map(lambda w: jnp.stack([w, 0.5 * w]), params)

    def stack(p, v):
        return jax.lax.scan(lambda h, lp: (h + moe_rhs(lp, h), None), v, p)[0]

    config = QConfig(weights=Scheme(bits=4, granularity="channel"), activations=None)
    qs = jaxq.quantize(stack, stacked, calibration=[(x,)], config=config)
    assert np.shape(qs.params["w2"].scale) == (2, E, 1, D)
    h = x
    for i in range(2):
        layer = jax.tree.map(lambda w, i=i: w[i], stacked)
        q1 = jaxq.quantize(lambda p, v: v + moe_rhs(p, v), layer, calibration=[(h,)], config=config)
        h = q1.apply(q1.params, h)
    np.testing.assert_allclose(qs.apply(qs.params, x), h, rtol=1e-5, atol=1e-5)


def test_int4_expert_weights_shard_along_their_experts_or_channels():
    # int4 codes packed along the experts (the first even axis): split along the channels, not
    # replicated (the experts were the one axis tried)
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    params = jax.tree.map(lambda w: jnp.concatenate([w, w[:1]]), expert_params())  # 4 experts
    x = jnp.asarray(np.random.default_rng(1).normal(size=(E + 1, T, D)), jnp.float32)
    config = QConfig(weights=Scheme(bits=4, granularity="channel"), activations=None)
    qf = jaxq.quantize(moe_rhs, params, example_args=(x,), config=config)
    shardings = jaxq.param_shardings(qf.params, mesh, "model")
    assert (
        shardings["w1"].codes.spec
        == shardings["w1"].scale.spec
        == PartitionSpec(None, None, "model")
    )
    placed = jax.device_put(qf.params, shardings)
    np.testing.assert_allclose(jax.jit(qf.apply)(placed, x), qf(x), rtol=1e-5, atol=1e-5)
