"""Weights as params: the quantized-params pytree, QAT on weights, and the phases as passes."""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from strategies import examples

import jaxq
from jaxq import quantize as Q
from jaxq.annotate import simulated_quantize
from jaxq.quantize import QArray, QConfig, QuantizeError, Rule, Scheme
from jaxq.quantize._state import get_state
from jaxq.transform import PassContext, PassTiming, Sequential, program_pass, rewrite

RNG = np.random.default_rng(0)


def model(params, x):
    """A small MLP in the Flax style: a dict of layers, kernels [in, out]; the second layer is
    written torch-style (``x @ w.T``) and the third runs its kernel in bfloat16 -> float32."""
    with jax.named_scope("Dense_0"):
        x = jax.nn.relu(x @ params["dense"][0]["kernel"] + params["dense"][0]["bias"])
    with jax.named_scope("Dense_1"):
        x = jax.nn.relu(x @ params["dense"][1]["weight"].T)
    with jax.named_scope("Dense_2"):
        x = x @ params["head"]["kernel"].astype(jnp.float32)
    return x * params["scale"]


def make_params(rng, k=12, h=16, n=5):
    return {
        "dense": [
            {
                "kernel": (rng.normal(size=(k, h)) * 0.4).astype(np.float32),
                "bias": (rng.normal(size=(h,)) * 0.1).astype(np.float32),
            },
            {"weight": (rng.normal(size=(h, h)) * 0.3).astype(np.float32)},  # [out, in]
        ],
        "head": {"kernel": jnp.asarray(rng.normal(size=(h, n)) * 0.3, jnp.bfloat16)},
        "scale": np.float32(1.5),
        "unused": None,
    }


P = make_params(RNG)
X = (RNG.normal(size=(6, 12))).astype(np.float32)
BATCHES = [(RNG.normal(size=(6, 12)).astype(np.float32),) for _ in range(3)]


@functools.cache
def realized():
    return Q(model, P, calibration=BATCHES, progress=False)


@functools.cache
def simulated():
    return Q(model, P, calibration=BATCHES, mode="simulate", progress=False)


def closure_style(params, config=None, mode="realize"):
    return Q(
        functools.partial(model, params),
        calibration=BATCHES,
        config=config,
        mode=mode,
        progress=False,
    )


# ---- the quantized params pytree ---------------------------------------------------------------


def test_params_are_a_pytree_of_qarrays_shaped_like_the_float_params():
    qf = realized()
    qp = qf.params
    assert jax.tree.structure(qp, is_leaf=lambda x: isinstance(x, QArray)) == jax.tree.structure(P)
    kernels = [qp["dense"][0]["kernel"], qp["dense"][1]["weight"], qp["head"]["kernel"]]
    assert all(isinstance(q, QArray) for q in kernels)
    assert kernels[1].shape == (16, 16) and np.shape(kernels[1].scale) == (16, 1)  # out channels
    assert kernels[0].codes.dtype == np.int8 and np.shape(kernels[0].scale) == (1, 16)
    assert kernels[2].dtype == jnp.bfloat16
    np.testing.assert_array_equal(qp["dense"][0]["bias"], P["dense"][0]["bias"])  # as given
    assert qp["unused"] is None
    # an ordinary pytree: tree.map, device_put, flatten with readable paths
    moved = jax.device_put(qp)
    assert isinstance(moved["head"]["kernel"], QArray)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(qp)[0]]
    assert "['dense'][0]['kernel'].codes" in paths and "['head']['kernel'].scale" in paths
    doubled = jax.tree.map(lambda a: a, qp)
    np.testing.assert_array_equal(doubled["dense"][0]["kernel"].codes, kernels[0].codes)


def test_flax_serialization_saves_and_restores_quantized_params():
    """Flax users save params with ``flax.serialization``; its msgpack refused a QArray. (Packed
    int4 codes with zero points, sums and activation scales: every field a QArray stores.)"""
    serialization = pytest.importorskip("flax.serialization")
    config = QConfig(weights=Scheme(bits=4, symmetric=False), activations=Scheme(symmetric=False))
    qf = Q(model, P, calibration=BATCHES, config=config, progress=False)
    data = serialization.to_bytes(qf.params)
    target = jax.tree.map(np.zeros_like, qf.params)
    restored = serialization.from_bytes(target, data)
    assert jax.tree.structure(restored) == jax.tree.structure(qf.params)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(qf.params), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(qf.apply(restored, X), qf(X))
    state = serialization.to_state_dict(qf.params)["dense"]["0"]["kernel"]
    assert {"codes", "scale", "zero_point", "act_scale", "act_zero_point"} <= set(state)
    # a state saved from params quantized without zero points does not fit these
    with pytest.raises(ValueError, match="lacks.*zero_point"):
        serialization.from_bytes(target, serialization.to_bytes(realized().params))


def test_realized_params_equal_closure_style_bit_for_bit():
    qf = realized()
    y = np.asarray(jax.jit(qf.apply)(qf.params, X))
    np.testing.assert_array_equal(y, np.asarray(closure_style(P)(X)))
    np.testing.assert_array_equal(np.asarray(qf(X)), y)
    ref = np.asarray(model(P, X))
    assert np.abs(y - ref).max() < 0.05 * np.abs(ref).max()


@pytest.mark.xla_cpu
def test_weights_are_arguments_not_constants():
    qf = realized()
    jaxpr = jax.make_jaxpr(qf.apply)(qf.params, X)
    assert all(np.size(c) <= 64 for c in jaxpr.consts)  # scales only, never a weight
    int8_inputs = [v for v in jaxpr.jaxpr.invars if v.aval.dtype == jnp.int8]
    assert len(int8_inputs) == 3
    program = qf.specialize(X)
    dots = [e for e in program.equations() if e.primitive == "dot_general"]
    assert len(dots) == 3 and all(e.params["preferred_element_type"] == jnp.int32 for e in dots)


def qarrays(params):
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QArray))
    return [q for q in leaves if isinstance(q, QArray)]


def test_code_sums_are_stored_so_no_call_reads_a_weight_twice():
    # asymmetric activations: the zero-point term za * sum(w) comes from each QArray's stored
    # sums (one int32 per output channel), never from summing the codes on every call
    qf = realized()
    for q, axis in zip(qarrays(qf.params), (0, 1, 0), strict=True):  # Dense_1 is [out, in]
        codes = np.asarray(q.int_codes(), np.int64)
        np.testing.assert_array_equal(np.asarray(q.sums), codes.sum(axis=axis, keepdims=True))
    weight_shapes = {q.shape for q in qarrays(qf.params)}
    sums = [
        e
        for e in qf.specialize(X).equations()
        if e.primitive == "reduce_sum" and tuple(e.in_avals[0].shape) in weight_shapes
    ]
    assert sums == []
    cfg = QConfig(activations=Scheme(symmetric=True))  # no activation zero point: no sums
    sym = Q(model, P, calibration=BATCHES, config=cfg, progress=False)
    assert [q.sums for q in qarrays(sym.params)] == [None] * 3


def test_activation_scales_travel_with_the_weights_as_inputs():
    # each layer's calibrated activation scale and zero point are leaves of the QArray of the
    # weight it multiplies: inputs of the program, never constants in it, so layers alike in
    # shape compile to the same code (XLA:CPU compiles a stack of them several times faster)
    qf = realized()
    act = get_state(qf.program, "test").act
    plans = get_state(qf.program, "test").leaves
    for q, plan in zip(
        qarrays(qf.params), sorted(plans.values(), key=lambda p: p.leaf), strict=True
    ):
        assert plan.act_site is not None and q.act_scale.shape == ()
        assert float(q.act_scale) == np.float32(act[plan.act_site].scale)
        assert int(q.act_zero_point) == act[plan.act_site].zero_point
    scales = {float(q.act_scale) for q in qarrays(qf.params)}
    literals = [
        float(v.val)
        for e in qf.specialize(X).equations()
        for v in e.eqn.invars
        if hasattr(v, "val") and np.ndim(v.val) == 0
    ]
    assert not scales & set(literals)
    again = qf.quantize_params(P)  # the calibrated scales are kept
    for a, b in zip(qarrays(again), qarrays(qf.params), strict=True):
        assert float(a.act_scale) == float(b.act_scale)
    # a symmetric signed scheme has no zero point to carry; dynamic scales none at all
    cfg = QConfig(activations=Scheme(symmetric=True))
    sym = Q(model, P, calibration=BATCHES, config=cfg, progress=False)
    assert all(q.act_zero_point is None and q.act_scale is not None for q in qarrays(sym.params))
    dyn = Q(model, P, example_args=(X,), config=QConfig(dynamic=True), progress=False)
    assert all(q.act_scale is None for q in qarrays(dyn.params))


def test_qarrays_are_immutable():
    q = qarrays(realized().params)[0]
    with pytest.raises(AttributeError, match="QArray is immutable.*'scale'.*jax.tree.map"):
        q.scale = q.scale * 2
    copied = jax.tree.map(lambda v: v, q)
    assert copied is not q and copied.shape == q.shape and copied.sums is q.sums


@pytest.mark.parametrize(
    "use",
    [np.asarray, jnp.asarray, jnp.sum, lambda q: X @ q, lambda q: jnp.asarray(X) @ q],
    ids=["np.asarray", "jnp.asarray", "jnp.sum", "numpy matmul", "jax matmul"],
)
def test_a_qarray_used_as_an_array_says_what_it_is(use):
    q = qarrays(realized().params)[0]
    with pytest.raises(TypeError, match=r"quantized weight .* q\.dequantize\(\)"):
        use(q)


def test_quantize_params_reuses_scales_and_new_shapes_reuse_everything():
    qf = realized()
    p2 = make_params(np.random.default_rng(7))
    before = copy.deepcopy(jax.tree.map(np.asarray, p2))
    qp2 = qf.quantize_params(p2)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, p2), before)  # not mutated
    assert not np.array_equal(qp2["head"]["kernel"].codes, qf.params["head"]["kernel"].codes)
    # the same float params give the same quantized params (deterministic, no re-calibration)
    again = qf.quantize_params(P)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(qf.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    y2 = np.asarray(qf.apply(qp2, X))
    assert np.abs(y2 - np.asarray(model(p2, X))).max() < 0.1 * np.abs(y2).max()
    x3 = RNG.normal(size=(3, 12)).astype(np.float32)  # another batch size
    np.testing.assert_array_equal(
        np.asarray(qf.apply(qf.params, x3)), np.asarray(closure_style(P)(x3))
    )
    assert np.asarray(jax.vmap(lambda x: qf.apply(qf.params, x[None])[0])(X)).shape == (6, 5)


def test_inputs_are_never_mutated():
    params = make_params(np.random.default_rng(3))
    before = copy.deepcopy(jax.tree.map(np.asarray, params))
    batches = [(b[0].copy(),) for b in BATCHES]
    qf = Q(model, params, calibration=batches, progress=False)
    qf.quantize_params(params)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), before)
    for (b,), (orig,) in zip(batches, BATCHES, strict=True):
        np.testing.assert_array_equal(b, orig)


# ---- QAT ---------------------------------------------------------------------------------------


def test_simulate_mode_fake_quantizes_the_params_it_is_given():
    qs = simulated()
    assert qs.params is not None and not isinstance(qs.params["head"]["kernel"], QArray)
    y0 = np.asarray(qs.apply(P, X))
    p2 = jax.tree.map(lambda a: a * 1.1 if hasattr(a, "shape") and a.ndim == 2 else a, P)
    y1 = np.asarray(qs.apply(p2, X))
    assert not np.array_equal(y0, y1)  # the weights given are used, not the calibrated ones
    # realize of the simulate function matches the realized one exactly
    np.testing.assert_array_equal(np.asarray(qs.realize()(X)), np.asarray(realized()(X)))


def test_qat_gradient_reaches_every_param_and_equals_the_ste_reference():
    qs = Q(
        lambda p, x: x @ p["w"] + p["b"],
        {"w": P["dense"][0]["kernel"], "b": P["dense"][0]["bias"]},
        calibration=BATCHES,
        mode="simulate",
        progress=False,
    )
    params = {"w": P["dense"][0]["kernel"], "b": P["dense"][0]["bias"]}
    g = jax.grad(lambda p: jnp.sum(qs.apply(p, X) ** 2))(params)
    # reference: fake-quantize x with the calibrated scale, w per channel with minmax scales;
    # straight-through: d/dw of (xq @ wq) is xq^T @ dy, as if wq were w
    state = get_state(qs.program, "t")
    a = state.act["dot_general"]
    xq = np.asarray(simulated_quantize(X, a.scale, a.zero_point, bits=8))
    w = params["w"]
    ws = np.abs(w).max(0) / 127
    wq = np.asarray(simulated_quantize(w, ws, np.zeros_like(ws), bits=8, axis=1, narrow_range=True))
    dy = 2 * (xq @ wq + params["b"])
    np.testing.assert_allclose(np.asarray(g["w"]), xq.T @ dy, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(g["b"]), dy.sum(0), rtol=2e-5, atol=2e-5)


# ---- bad input ---------------------------------------------------------------------------------


def test_an_empty_first_calibration_batch_is_passed_over():
    # (f was traced at the empty batch: every layer empty, the model came back float, silently)
    empty = (np.zeros((0, 12), np.float32),)
    qf = Q(model, P, calibration=[empty, *BATCHES], progress=False)
    want = realized()
    for a, b in zip(jax.tree.leaves(qf.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(QuantizeError, match=r"every calibration batch \(2\) holds an empty"):
        Q(model, P, calibration=[empty, empty], progress=False)


def test_bad_params_get_errors_that_name_the_path():
    qf, qs = realized(), simulated()
    with pytest.raises(QuantizeError, match=r"params\['dense'\]\[0\]\['kernel'\] is a float array"):
        qf.apply(P, X)
    with pytest.raises(QuantizeError, match=r"params\['head'\]\['kernel'\] is a QArray.*realize"):
        qs.apply({**P, "head": qf.params["head"]}, X)
    # (the first difference in words: two printed trees hide a FrozenDict for a dict)
    with pytest.raises(QuantizeError, match=r"params holds \['dense', 'scale', 'unused'\] where"):
        qf.quantize_params({k: v for k, v in P.items() if k != "head"})
    from flax.core import FrozenDict

    frozen = {**P, "head": FrozenDict(P["head"])}
    with pytest.raises(QuantizeError, match=r"params\['head'\] is a FrozenDict where .* a dict"):
        qf.quantize_params(frozen)
    with pytest.raises(QuantizeError, match=r"params\['dense'\]\[1\] is a list where .* a dict"):
        qf.quantize_params({**P, "dense": [P["dense"][0], [P["dense"][1]["weight"]]]})
    bad = copy.deepcopy(P)
    bad["dense"][1]["weight"] = np.zeros((16, 8), np.float32)
    with pytest.raises(
        QuantizeError, match=r"params\['dense'\]\[1\]\['weight'\]: expected float32\[16,16\]"
    ):
        qf.quantize_params(bad)
    with pytest.raises(
        QuantizeError, match=r"\['dense'\]\[0\]\['kernel'\] is a QArray.*takes the float"
    ):
        qf.quantize_params(qf.params)
    with pytest.raises(QuantizeError, match="QArrays already"):
        Q(model, qf.params, calibration=BATCHES, progress=False)
    with pytest.raises(ValueError, match="not both"):
        Q(model, P, calibration=BATCHES, weight_argnums=0, progress=False)
    with pytest.raises(TypeError, match="closed over"):
        closure_style(P).apply(P, X)
    with pytest.raises(QuantizeError, match="no derivative"):
        jax.grad(lambda x: qf.apply(qf.params, x).sum())(X)
    with pytest.raises(QuantizeError, match="no derivative"):
        jax.grad(lambda x: closure_style(P)(x).sum())(X)
    with pytest.raises(QuantizeError, match="inside a JAX transformation"):
        jax.grad(lambda p: Q(model, p, calibration=BATCHES, progress=False)(X).sum())(P)
    with_fn = {**P, "activation": jax.nn.relu}  # (an Equinox module holds functions too)
    with pytest.raises(TypeError, match=r"params\['activation'\] is a .* eqx\.partition"):
        Q(model, with_fn, calibration=BATCHES, progress=False)

    class Variable:  # (Keras' model.trainable_variables: jit's own error was raw)
        shape, dtype = (12, 16), np.dtype(np.float32)

        def __jax_array__(self):
            return jnp.zeros(self.shape)

    with pytest.raises(TypeError, match=r"params\[0\] is a Variable.*v\.value for v in"):
        Q(lambda p, x: x @ p[0], [Variable()], calibration=BATCHES, progress=False)


# ---- the phases are passes ---------------------------------------------------------------------


def mlp(x):
    with jax.named_scope("Dense_0"):
        x = jax.nn.relu(x @ P["dense"][0]["kernel"])
    with jax.named_scope("Dense_1"):
        return x @ P["dense"][1]["weight"]


def test_a_user_pass_between_phases_is_kept():
    """``Sequential([annotate, my_pass, calibrate, realize])``: my_pass's change reaches the
    result (realize used to lower the float program kept by annotate, dropping it)."""

    @program_pass(name="tanh_after_relu")
    def my_pass(program):
        return rewrite(program, {"max": lambda visit, *xs: jnp.tanh(visit.bind(*xs))})

    cfg = QConfig()
    pipeline = Sequential(
        [Q.annotate(cfg), my_pass, Q.calibrate([(X,)], progress=False), Q.realize()]
    )
    out = pipeline(jaxq.trace(mlp, X))
    assert any(e.primitive == "tanh" for e in out.equations())
    plain = Sequential([Q.annotate(cfg), Q.calibrate([(X,)], progress=False), Q.realize()])
    assert not any(e.primitive == "tanh" for e in plain(jaxq.trace(mlp, X)).equations())
    ref = jax.nn.relu(X @ P["dense"][0]["kernel"])
    want = np.tanh(ref) @ P["dense"][1]["weight"]
    got = np.asarray(out(X))
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    assert get_state(out, "t").mode == "realize"


def test_a_pass_that_removes_a_layer_is_named():
    @program_pass(name="drop_dense_1")
    def drop(program):
        return rewrite(
            program,
            {"dot_general": lambda v, a, b: v.bind(a, b) if a.shape[1] == 12 else a[:, :16]},
        )

    annotated = Q.annotate(QConfig())(jaxq.trace(mlp, X))
    with pytest.raises(QuantizeError, match="Dense_1/dot_general"):
        Q.calibrate([(X,)], progress=False)(drop(annotated))


def test_instruments_see_the_phases_and_realize_can_be_disabled():
    timing = PassTiming()
    with PassContext(instruments=[timing]):
        Q(model, P, calibration=BATCHES, progress=False)
    names = [n for n, _ in timing.records if n.startswith("quantize")]
    assert names == ["quantize.annotate", "quantize.calibrate", "quantize.realize"]
    with PassContext(disabled=["quantize.realize"]):
        qf = Q(model, P, calibration=BATCHES, progress=False)
    assert qf.mode == "simulate" and not isinstance(qf.params["head"]["kernel"], QArray)
    np.testing.assert_array_equal(np.asarray(qf(X)), np.asarray(simulated()(X)))


def test_pass_level_pipeline_with_params():
    prog = jaxq.trace(model, P, X)
    data = [(P, b[0]) for b in BATCHES]
    out = Sequential(
        [Q.annotate(QConfig(), params_argnum=0), Q.calibrate(data, progress=False), Q.realize()]
    )(prog)
    qf = realized()
    np.testing.assert_array_equal(np.asarray(out(qf.params, X)), np.asarray(qf(X)))


# ---- random param pytrees ------------------------------------------------------------------------


@st.composite
def param_models(draw):
    """A chain of dense layers whose params sit at random places of a nested pytree (dicts,
    lists, None leaves), some stored [out, in] (used transposed), some with a bias."""
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    n_layers = draw(st.integers(1, 3))
    sizes = [draw(st.integers(2, 9)) for _ in range(n_layers + 1)]
    layers, uses = [], []
    for i in range(n_layers):
        k, n = sizes[i], sizes[i + 1]
        transposed = draw(st.booleans())
        w = (rng.normal(size=(n, k) if transposed else (k, n)) * 0.5).astype(np.float32)
        layer = {"w": w, "extra": None} if draw(st.booleans()) else [w]
        if draw(st.booleans()):
            b = (rng.normal(size=(n,)) * 0.1).astype(np.float32)
            layer = {"w": w, "b": b} if isinstance(layer, dict) else [w, b]
        layers.append(layer)
        uses.append(transposed)
    params = {"blocks": layers} if draw(st.booleans()) else [None, layers]

    def get(p):
        return p["blocks"] if isinstance(p, dict) else p[1]

    def f(p, x):
        for i, (layer, transposed) in enumerate(zip(get(p), uses, strict=True)):
            w = layer["w"] if isinstance(layer, dict) else layer[0]
            b = (
                layer.get("b")
                if isinstance(layer, dict)
                else (layer[1] if len(layer) > 1 else None)
            )
            with jax.named_scope(f"L{i}"):
                x = x @ (w.T if transposed else w)
                x = x + b if b is not None else x
                x = jnp.tanh(x) if i < len(uses) - 1 else x
        return x

    x = rng.normal(size=(draw(st.integers(1, 4)), sizes[0])).astype(np.float32)
    return f, params, x


@settings(max_examples=examples(12), deadline=None)
@given(param_models(), st.sampled_from(["static", "dynamic", "weights"]))
def test_random_param_pytrees_realize_like_the_closure_style(case, acts):
    f, params, x = case
    config = {
        "static": QConfig(),
        "dynamic": QConfig(dynamic=True),
        "weights": QConfig(weights=Scheme(bits=4, granularity="channel"), activations=None),
    }[acts]
    calib = [(x,), (x * 0.5,)]
    before = jax.tree.map(np.copy, params)
    qf = Q(f, params, calibration=calib, config=config, progress=False)
    closure = Q(functools.partial(f, params), calibration=calib, config=config, progress=False)
    # Integer code is bit-exact (jitted against jitted: XLA fuses the rescale and the bias add
    # into one multiply-add). Weight-only layers run a float dot on the codes, whose summation
    # order XLA may choose differently for a constant (folded transpose) and an input weight.
    same = (
        np.testing.assert_array_equal
        if acts != "weights"
        else functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7)
    )
    apply = jax.jit(qf.apply)
    want = np.asarray(jax.jit(closure)(x))
    same(np.asarray(apply(qf.params, x)), want)
    same(np.asarray(apply(qf.quantize_params(params), x)), want)
    jax.tree.map(np.testing.assert_array_equal, params, before)


def test_rules_and_group_schemes_on_params():
    cfg = QConfig(
        weights=Scheme(bits=4, granularity="group", group_size=4, symmetric=False),
        activations=None,
        rules=(Rule(pattern="Dense_2", skip=True),),
    )
    qf = Q(model, P, config=cfg, example_args=(X,), progress=False)
    assert not isinstance(qf.params["head"]["kernel"], QArray)
    k0 = qf.params["dense"][0]["kernel"]
    assert k0.bits == 4 and k0.codes.shape == (6, 16) and np.shape(k0.scale) == (3, 16)
    closure = Q(functools.partial(model, P), config=cfg, example_args=(X,), progress=False)
    np.testing.assert_array_equal(np.asarray(qf(X)), np.asarray(closure(X)))
    assert qf.report().param_bytes < closure.report().param_bytes + 16 * 12 * 4


def test_rules_match_the_param_path_of_a_layers_weight():
    # layers named by primitive only (no named scopes, as in Equinox's vmap(eqx.nn.Linear)/
    # dot_general_3) are picked by the path of the param they read; closed over, names only
    def mlp(params, x):
        for layer in params["layers"]:
            x = jax.nn.relu(x @ layer["w"])
        return x

    params = {"layers": [{"w": (RNG.normal(size=(12, 12)) * 0.3).astype(np.float32)}] * 3}
    cfg = QConfig(rules=(Rule(pattern=r"\['layers'\]\[1\]", weights=Scheme(bits=4)),))
    qf = Q(mlp, params, calibration=BATCHES, config=cfg, progress=False)
    assert [layer["w"].bits for layer in qf.params["layers"]] == [8, 4, 8]
    report = qf.report()
    assert [r.status for r in report.layers] == ["quantized"] * 3 and not report.unmatched_rules
    with pytest.warns(UserWarning, match=r"matched no equation.*keystr"):
        closed = Q(functools.partial(mlp, params), calibration=BATCHES, config=cfg, progress=False)
    assert closed.report().unmatched_rules  # (constants have no param path)


def test_one_layer_dynamic_per_token_in_a_static_config():
    # a rule makes one layer dynamic per token (scales from each row at run time), the others
    # keep calibrated scales; that layer computes as in a dynamic config: with the other layers
    # left float, the same outputs as QConfig(dynamic=True) per token, bit for bit
    token = Scheme(granularity="token", symmetric=False)
    rest = (Rule(pattern="Dense_0|Dense_2", skip=True),)
    mixed = QConfig(rules=(*rest, Rule(pattern="Dense_1", activations=token)))
    a = Q(model, P, calibration=BATCHES, config=mixed, progress=False)
    b = Q(model, P, example_args=(X,), config=QConfig(dynamic=True, activations=token, rules=rest))
    want = np.asarray(jax.jit(b.apply)(b.params, X))
    np.testing.assert_array_equal(np.asarray(jax.jit(a.apply)(a.params, X)), want)
    cfg = QConfig(rules=(Rule(pattern="Dense_1", activations=token),))
    qf = Q(model, P, calibration=BATCHES, config=cfg, progress=False)
    assert [layer.activations for layer in qf.report().layers] == [
        "int8 asym tensor static", "int8 asym token dynamic", "int8 asym tensor static"
    ]  # fmt: skip
    assert qf.params["dense"][1]["weight"].act_scale is None
    assert qf.params["dense"][0]["kernel"].act_scale is not None
    with pytest.raises(ValueError, match=r"fixed_point.*per-token activations in rules\[0\]"):
        QConfig(requantize="fixed_point", rules=cfg.rules)


# ---- sharding ----------------------------------------------------------------------------------


def test_param_shardings_split_qarrays_along_output_channels():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    qf = realized()
    shardings = jaxq.param_shardings(qf.params, mesh, "model")
    k0, w1 = shardings["dense"][0]["kernel"], shardings["dense"][1]["weight"]
    assert k0.codes.spec == PartitionSpec(None, "model") and k0.scale.spec == k0.codes.spec
    assert w1.codes.spec == PartitionSpec("model", None)  # [out, in]: out channels first
    assert shardings["dense"][0]["bias"].spec == PartitionSpec()  # small leaves replicated
    assert shardings["head"]["kernel"].codes.spec == PartitionSpec()  # 5 channels: no even split
    placed = jax.device_put(qf.params, shardings)
    codes = placed["dense"][0]["kernel"].codes
    assert codes.addressable_shards[0].data.shape == (12, 8)  # each device: half the channels
    x = jax.device_put(X, NamedSharding(mesh, PartitionSpec("data")))
    got = np.asarray(jax.jit(qf.apply)(placed, x))
    # sharded float rescales may round differently in the last digit (jax 0.12): a tight bound
    np.testing.assert_allclose(
        got, np.asarray(jax.jit(qf.apply)(qf.params, X)), rtol=1e-6, atol=1e-6
    )
    # the shardings pytree is a prefix JAX accepts where it builds trees of its own (jit's
    # in_shardings / out_shardings fill a QArray with None leaves): same structure, same results
    kernel = qf.params["dense"][0]["kernel"]
    empty = jax.tree.unflatten(jax.tree.structure(kernel), [None] * len(jax.tree.leaves(kernel)))
    assert jax.tree.structure(empty, is_leaf=lambda v: v is None) == jax.tree.structure(kernel)
    data = NamedSharding(mesh, PartitionSpec("data"))
    run = jax.jit(qf.apply, in_shardings=(shardings, data))
    np.testing.assert_array_equal(np.asarray(run(placed, x)), got)
    moved = jax.jit(lambda p: p, out_shardings=shardings)(qf.params)
    assert moved["dense"][0]["kernel"].codes.sharding == k0.codes
    with pytest.raises(ValueError, match="mesh has no axis 'tensor'"):
        jaxq.param_shardings(qf.params, mesh, "tensor")


def test_quantized_apply_runs_inside_shard_map_without_vma_checks():
    """Data parallelism by ``shard_map`` (params replicated), as ``param_shardings`` documents."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    from jax.sharding import Mesh, PartitionSpec

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    qf = realized()
    x = X[:4]
    run = shard_map(
        qf.apply,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec("data")),
        out_specs=PartitionSpec("data"),
        check_vma=False,
    )
    np.testing.assert_allclose(np.asarray(jax.jit(run)(qf.params, x)), np.asarray(qf(x)), rtol=1e-6)
    # the program traced for one shard's shape under that mesh is not reused under another
    # mesh or under pmap (it raised "context mesh ... should match the aval mesh")
    other = Mesh(np.array(jax.devices()[:4]), ("batch",))
    specs = (PartitionSpec(), PartitionSpec("batch"))
    run = shard_map(
        qf.apply, mesh=other, in_specs=specs, out_specs=PartitionSpec("batch"), check_vma=False
    )
    np.testing.assert_allclose(np.asarray(jax.jit(run)(qf.params, x)), np.asarray(qf(x)), rtol=1e-6)
    y = jax.pmap(qf.apply, in_axes=(None, 0))(qf.params, x.reshape(4, 1, -1))
    np.testing.assert_allclose(np.asarray(y).reshape(4, -1), np.asarray(qf(x)), rtol=1e-6)
    # params split over the shards: one shard's slice of a weight is named, with the two ways
    # (it said "trace it again for new shapes (jaxq.trace(...))")
    split = jax.tree.map(lambda s: s.spec, jaxq.param_shardings(qf.params, other, "batch"))
    run = shard_map(
        qf.apply,
        mesh=other,
        in_specs=(split, PartitionSpec()),
        out_specs=PartitionSpec(),
        check_vma=False,
    )
    with pytest.raises(QuantizeError, match=r"'s codes are shaped \(12, 4\), not .*shard_map"):
        jax.jit(run)(qf.params, x)


def test_int4_codes_packed_along_their_channels_are_replicated():
    """With every other axis odd, int4 codes are packed along the output channels (byte ``j``
    holds channels ``j`` and ``j + C/2``): split bytes would not match split scales, and each call
    would gather the weight, so the QArray is replicated."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    rng = np.random.default_rng(12)
    params = {
        "odd": rng.normal(size=(15, 64)).astype(np.float32),
        "even": rng.normal(size=(64, 32)).astype(np.float32),
    }
    cfg = QConfig(weights=Scheme(bits=4, granularity="channel"), activations=None)
    x = rng.normal(size=(2, 15)).astype(np.float32)
    mlp = lambda p, x: jnp.tanh(x @ p["odd"]) @ p["even"]
    qf = Q(mlp, params, example_args=(x,), config=cfg, progress=False)
    shardings = jaxq.param_shardings(qf.params, mesh, "model")
    assert shardings["odd"].codes.spec == shardings["odd"].scale.spec == PartitionSpec()
    assert shardings["even"].codes.spec == PartitionSpec(None, "model")  # packed along rows
    placed = jax.device_put(qf.params, shardings)
    got = np.asarray(jax.jit(qf.apply)(placed, x))  # (a sharded float dot: its rounding)
    np.testing.assert_allclose(got, np.asarray(qf(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wsym", [True, False])
@pytest.mark.parametrize("padding", ["SAME", ((2, 0), (1, 1))])
def test_convolution_params_equal_closure_style(wsym, padding):
    """Padded convolutions: with params the activation is padded with its zero point (the
    closure style folds border sums from constant weights instead); the results agree exactly."""
    k = (np.random.default_rng(5).normal(size=(3, 3, 3, 20)) * 0.3).astype(np.float32)
    imgs = np.random.default_rng(6).normal(size=(2, 7, 7, 3)).astype(np.float32)

    def cnn(p, x):
        y = jax.lax.conv_general_dilated(
            x, p["k"], (2, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jax.nn.relu(y)

    cfg = QConfig(weights=Scheme(granularity="channel", symmetric=wsym, narrow_range=wsym))
    qf = Q(cnn, {"k": k}, calibration=[(imgs,)], config=cfg, progress=False)
    closure = Q(functools.partial(cnn, {"k": k}), calibration=[(imgs,)], config=cfg, progress=False)
    np.testing.assert_array_equal(np.asarray(qf(imgs)), np.asarray(closure(imgs)))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(qf.apply)(qf.params, imgs)), np.asarray(jax.jit(closure)(imgs))
    )


@pytest.mark.xla_cpu
@pytest.mark.parametrize("wsym, chunks", [(True, 3), (False, 6)])
def test_without_an_s8_convolution_the_sums_run_in_f32_channel_chunks(wsym, chunks):
    """XLA:GPU has no int8 x int8 -> int32 convolution (the program failed to compile on an
    H100), so the GPU tuning carries every convolution's sums in f32, in input-channel chunks
    where one f32 sum could reach 2**24 (3x3 x 160 channels of any params' codes can); the
    integers are those of the s8 convolution."""
    gpu = Q.tuning(platform="gpu")
    assert not gpu.s8_conv and Q.tuning(platform="cpu").s8_conv
    rng = np.random.default_rng(9)
    k = (rng.normal(size=(3, 3, 160, 8)) * 0.1).astype(np.float32)
    imgs = rng.normal(size=(2, 4, 4, 160)).astype(np.float32)

    def cnn(p, x):
        dn = ("NHWC", "HWIO", "NHWC")
        return jax.lax.conv_general_dilated(x, p["k"], (1, 1), "SAME", dimension_numbers=dn)

    cfg = QConfig(weights=Scheme(granularity="channel", symmetric=wsym))
    qf = Q(cnn, {"k": k}, calibration=[(imgs,)], config=cfg, progress=False)
    with PassContext(config={"quantize.tuning": gpu}):
        jaxpr = str(jax.make_jaxpr(qf.apply)(qf.params, imgs))
        got = jax.jit(qf.apply)(qf.params, imgs)
    assert jaxpr.count("conv_general_dilated[") == chunks
    assert "preferred_element_type=int32" not in jaxpr
    with PassContext(config={"quantize.tuning": dataclasses.replace(gpu, s8_conv=True)}):
        s8 = jax.jit(qf.apply)(qf.params, imgs)
        assert "preferred_element_type=int32" in str(jax.make_jaxpr(qf.apply)(qf.params, imgs))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(s8))


@pytest.mark.parametrize("granularity", ["token", "tensor"])
def test_qat_gradients_pass_straight_through_an_int8_attention_product(granularity):
    """Simulate's product of two activations (QConfig.attention) rounded its codes with
    jnp.round, whose derivative is 0: q and k got gradients at cosine 0.37 and 0.21 to float's.
    Straight through, they are float's within the weights' own rounding."""
    rng = np.random.default_rng(0)
    params = {k: rng.normal(size=(8, 8)).astype(np.float32) for k in "qk"}
    x, c = rng.normal(size=(4, 8)).astype(np.float32), rng.normal(size=(4, 4)).astype(np.float32)
    f = lambda p, x: (x @ p["q"]) @ (x @ p["k"]).T
    cfg = QConfig(activations=None, attention=Scheme(granularity=granularity))
    qs = Q(f, params, calibration=[(x,)], config=cfg, mode="simulate", progress=False)
    loss = lambda g: lambda p: jnp.sum(g(p, x) * c)
    got, want = jax.grad(loss(qs.apply))(params), jax.grad(loss(f))(params)
    for k in params:
        rel = np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])
        assert rel < 0.05, (k, rel)


@pytest.mark.xla_cpu
@pytest.mark.parametrize("granularity", ["channel", "group"])
def test_without_a_sound_s8_dot_the_sums_run_in_f32_chunks(granularity):
    """XLA:GPU's int8 dot gave wrong sums for some shapes (an H200), so the GPU tuning carries
    every int8 dot's sums in f32, in chunks of the contracted axis short enough that each sum
    stays below 2**24 (1100 int8 products can reach it): the weights' dot, group-wise, and an
    attention-style product of two activations; the integers are those of the s8 dot."""
    gpu = Q.tuning(platform="gpu")
    assert not gpu.s8_dot and Q.tuning(platform="cpu").s8_dot
    rng = np.random.default_rng(10)
    w = (rng.normal(size=(1100, 8)) * 0.1).astype(np.float32)
    x = rng.normal(size=(2, 3, 1100)).astype(np.float32)

    def f(p, x):
        h = x @ p["w"]
        return jnp.einsum("btd,bsd->bts", h, h)

    cfg = QConfig(
        weights=Scheme(granularity=granularity, group_size=550 if granularity == "group" else None),
        attention=Scheme(granularity="token"),
    )
    qf = Q(f, {"w": w}, calibration=[(x,)], config=cfg, progress=False)
    with PassContext(config={"quantize.tuning": gpu}):
        jaxpr = str(jax.make_jaxpr(qf.apply)(qf.params, x))
        got = jax.jit(qf.apply)(qf.params, x)
    assert "preferred_element_type=int32" not in jaxpr
    assert jaxpr.count("dot_general[") == (3 if granularity == "channel" else 2)
    with PassContext(config={"quantize.tuning": dataclasses.replace(gpu, s8_dot=True)}):
        s8 = jax.jit(qf.apply)(qf.params, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(s8))


@pytest.mark.xla_cpu
def test_without_int8_kernels_merged_axes_and_grouped_convolutions_run_in_chunks():
    """The f32 routes (found by a helper, which the GPU entry refused): a dot contracting over
    two axes, the second 1100 long (merged into one axis, then cut), and a convolution of two
    groups of 100 channels (each group's channels cut alike); a kernel whose one input channel
    alone can reach 2**24 is refused, naming its positions."""
    gpu = Q.tuning(platform="gpu")
    rng = np.random.default_rng(11)
    dn = ("NHWC", "HWIO", "NHWC")
    params = {
        "w": (rng.normal(size=(2, 1100, 8)) * 0.1).astype(np.float32),
        "k": (rng.normal(size=(3, 3, 100, 16)) * 0.1).astype(np.float32),
    }
    x = rng.normal(size=(4, 2, 1100)).astype(np.float32)
    img = rng.normal(size=(2, 5, 5, 200)).astype(np.float32)

    def f(p, x, img):
        conv = jax.lax.conv_general_dilated(
            img, p["k"], (1, 1), "SAME", dimension_numbers=dn, feature_group_count=2
        )
        return jnp.einsum("bij,ijk->bk", x, p["w"]), conv

    qf = Q(f, params, config=QConfig(dynamic=True), example_args=(x, img), progress=False)
    with PassContext(config={"quantize.tuning": gpu}):
        jaxpr = str(jax.make_jaxpr(qf.apply)(qf.params, x, img))
        got = jax.jit(qf.apply)(qf.params, x, img)
    assert "preferred_element_type=int32" not in jaxpr
    assert jaxpr.count("dot_general[") == 3 and jaxpr.count("conv_general_dilated[") == 2
    s8 = jax.jit(qf.apply)(qf.params, x, img)
    for a, b in zip(got, s8, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def long(p, x):
        return jax.lax.conv_general_dilated(
            x, p["k"], (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC")
        )

    cfg = QConfig(dynamic=True, weights=Scheme(granularity="channel", symmetric=False))
    k300 = {"k": rng.normal(size=(300, 1, 2)).astype(np.float32)}
    qf = Q(long, k300, config=cfg, example_args=(np.ones((1, 320, 1), np.float32),), progress=False)
    pinned = PassContext(config={"quantize.tuning": gpu})
    with pinned, pytest.raises(QuantizeError, match="kernel of 300 positions"):
        qf(np.ones((1, 320, 1), np.float32))


@settings(max_examples=examples(8), deadline=None)
@given(param_models())
def test_random_param_pytrees_get_straight_through_gradients(case):
    """QAT: the gradient of the simulated function with respect to every param equals that of
    the same program with each quantizer written as ``x + stop_gradient(q(x) - x)``."""
    f, params, x = case
    qs = Q(f, params, calibration=[(x,)], mode="simulate", progress=False)
    program = qs.specialize(x)

    def ste(visit, v, *rest):
        return v + jax.lax.stop_gradient(visit.bind(v, *rest) - v)

    reference = rewrite(program, {"simulated_quantize": ste}).as_fun()
    loss = lambda fun: lambda p: jnp.sum(jnp.sin(fun(p, x)))
    got = jax.jit(jax.grad(loss(qs.apply)))(params)
    want = jax.jit(jax.grad(loss(reference)))(params)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5),
        got,
        want,
    )
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(got))


def test_saved_file_names_tensors_by_param_path_and_loads_under_vmap(tmp_path):
    from safetensors import safe_open

    qf = realized()
    path = qf.save(tmp_path / "model.jaxq")
    with safe_open(str(path), framework="numpy") as fh:
        keys = set(fh.keys())
    assert {"dense/0/kernel.codes", "dense/0/kernel.scale", "head/kernel.codes"} <= keys
    loaded = jaxq.load(path)
    np.testing.assert_array_equal(np.asarray(loaded(X)), np.asarray(jax.jit(qf)(X)))
    batched = np.asarray(jax.vmap(loaded)(np.stack([X, X * 0.5])))
    np.testing.assert_array_equal(batched[1], np.asarray(jax.jit(qf)(X * 0.5)))
    # saved with a symbolic batch: any batch size runs (one row within float rounding: the
    # jitted function carries a row's sums in f32, the saved program takes the s8 kernel)
    np.testing.assert_array_equal(np.asarray(loaded(X[:3])), np.asarray(jax.jit(qf)(X[:3])))
    np.testing.assert_allclose(
        np.asarray(loaded(X[:1])), np.asarray(jax.jit(qf)(X[:1])), rtol=1e-5, atol=1e-6
    )


def test_a_model_that_fixes_its_batch_saves_at_its_shapes_and_says_why(tmp_path):
    def f(p, x):
        return (x.reshape(6, 3, 4).sum(1) @ p["w"]).reshape(6, -1)  # (6: the batch, fixed)

    qf = Q(f, {"w": P["dense"][0]["kernel"][:4]}, calibration=BATCHES, progress=False)
    with pytest.warns(UserWarning, match="runs only at the traced shapes: no leading dimension"):
        saved = qf.save(tmp_path / "fixed.jaxq")
    loaded = jaxq.load(saved)
    np.testing.assert_array_equal(np.asarray(loaded(X)), np.asarray(jax.jit(qf)(X)))
    with pytest.raises(
        TypeError,
        match=r"symbolic batch(.|\n)*args\[0\]: saved for float32\[6,12\], got "
        r"float32\[3,12\] \(axis 0 is fixed at 6\)",
    ):
        loaded(X[:3])


def test_an_int8_convolution_run_as_one_dot_saves_with_a_symbolic_batch(tmp_path):
    """Realize's choice of one s8 dot on a convolution's windows (im2col) compared their bytes, a
    symbolic number under a polymorphic export, with its bounds: the trace failed and save fell
    back to the traced batch (W8A8 CNNs). With the batch unknown it takes the s8 convolution."""
    dn = ("NHWC", "HWIO", "NHWC")
    p = {"w": (RNG.normal(size=(3, 3, 16, 16)) * 0.1).astype(np.float32)}
    f = lambda p, x: lax.conv_general_dilated(x, p["w"], (1, 1), "SAME", dimension_numbers=dn)
    x = RNG.normal(size=(4, 24, 24, 16)).astype(np.float32)  # (windows: 324 KiB, in range)
    qf = Q(f, p, calibration=[(x,)], progress=False)
    assert "= dot_general[" in str(qf.specialize(x))  # (im2col at the traced batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = jaxq.load(qf.save(tmp_path / "conv.jaxq"))
    np.testing.assert_array_equal(np.asarray(loaded(x[:2])), np.asarray(jax.jit(qf)(x[:2])))


def test_save_finds_the_batch_beside_other_arguments(tmp_path):
    """LoRA adapters as an argument: save took the first argument leaf's leading dimension as the
    batch (an adapter's, or the input's together with an adapter's of the same size), failed,
    and saved at the traced shapes, warning that the model "does not run with a symbolic
    batch". It tries the other leading dimensions and each argument alone."""
    w = {"w": P["dense"][0]["kernel"]}  # (12 -> 16)
    lora = {"a": np.full((12, 2), 0.1, np.float32), "b": np.full((2, 16), 0.1, np.float32)}
    x12 = RNG.normal(size=(12, 12)).astype(np.float32)  # (batch 12, as lora["a"]'s rows)

    def before(p, lora, x):
        return x @ p["w"] + (x @ lora["a"]) @ lora["b"]

    def beside(p, x, lora):
        return before(p, lora, x)

    for f, batch in ((before, (lora, X)), (beside, (x12, lora))):
        qf = Q(f, w, calibration=[batch], progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loaded = jaxq.load(qf.save(tmp_path / f"{f.__name__}.jaxq"))
        small = tuple(v[:3] if v is X or v is x12 else v for v in batch)
        np.testing.assert_allclose(loaded(*small), qf(*small), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_models_save_with_a_symbolic_batch(tmp_path, bits):
    """Weight-only realize compared the output's size with the weight's, which a symbolic batch
    cannot answer: jax.export failed and save fell back to the traced batch without a word."""
    from jax import export

    cfg = QConfig(weights=Scheme(bits=bits), activations=None)
    qf = Q(model, P, calibration=BATCHES, config=cfg, progress=False)
    (b,) = export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, X.shape[1]), X.dtype)
    assert str(export.export(jax.jit(qf.apply))(qf.params, spec).in_avals[-1]) == "float32[b,12]"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = jaxq.load(qf.save(tmp_path / "w.jaxq"))
    np.testing.assert_allclose(loaded(X[:3]), qf(X[:3]), rtol=1e-5, atol=1e-6)
    # (per-tensor weights, one of them transposed: that layout crashed quantize_params)
    sim = Q(model, P, calibration=BATCHES, config=cfg, mode="simulate", progress=False)
    np.testing.assert_allclose(qf(X), sim(X), rtol=1e-4, atol=1e-5)


def test_arrays_made_at_the_batch_size_export_with_a_symbolic_batch(tmp_path):
    """``jnp.zeros((x.shape[0], d))`` (an empty cache or state; Equinox's LayerNorm under vmap
    makes one too) has no array input, so realize evaluated it on the host as a constant, which
    a symbolic batch cannot be: export failed and save fell back to the traced batch."""
    from jax import export

    def f(p, x):
        return model(p, x + jnp.zeros((x.shape[0], x.shape[1]), x.dtype))

    qf = Q(f, P, calibration=BATCHES, progress=False)
    (b,) = export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, X.shape[1]), X.dtype)
    assert str(export.export(jax.jit(qf.apply))(qf.params, spec).in_avals[-1]) == "float32[b,12]"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = jaxq.load(qf.save(tmp_path / "z.jaxq"))
    np.testing.assert_allclose(loaded(X[:3]), qf(X[:3]), rtol=1e-5, atol=1e-6)
    # (jax.export's symbolic sizes are >= 1: an empty batch is named, not JAX's internal error)
    with pytest.raises(ValueError, match=r"sizes of 1 or more(.|\n)*args\[0\]: saved for"):
        loaded(X[:0])
    # (another axis than the batch: the error names it, not the batch, as what to pad)
    with pytest.raises(
        TypeError, match=r"got float32\[3,5\] \(axis 1 is fixed at 12\)(.|\n)*pad the fixed axes"
    ):
        loaded(X[:3, :5])


@pytest.mark.parametrize("mode", ["realize", "simulate"])
@pytest.mark.parametrize("closed", [True, False])
def test_layers_in_another_order_at_new_shapes_are_an_error_not_wrong_scales(closed, mode):
    """Layers are matched by name, and names follow program order: a function whose layer order
    depends on its argument shapes must not run a layer with another's codes and activation
    scale (closed over, it did: relative error 1.0, 98% of one layer's inputs clipped)."""
    w = {k: (RNG.normal(size=(12, 4)) / 4).astype(np.float32) for k in "ac"}

    def f(p, x, y):
        if x.shape[0] <= 6:
            u, v = x @ p["a"], y @ p["c"]
        else:  # (the same, in the other order)
            v, u = y @ p["c"], x @ p["a"]
        return u + v

    cal = [(X, 100 * X[::-1])]
    kw = dict(calibration=cal, progress=False, mode=mode)
    qf = Q(functools.partial(f, w), **kw) if closed else Q(f, w, **kw)
    want = f(w, *cal[0])
    assert np.linalg.norm(qf(*cal[0]) - want) < 0.02 * np.linalg.norm(want)
    big = np.concatenate([X, X])
    match = "another weight than|another order at these argument shapes"
    with pytest.raises(QuantizeError, match=match):
        qf(big, 100 * big)


@pytest.mark.parametrize("activations", [Scheme(symmetric=False), None])
def test_a_tied_weight_read_transposed_runs_in_simulate_as_realize_deploys_it(activations):
    """An encoder/decoder sharing ``w`` (``x @ w``, then ``h @ w.T``): the second layer stays
    float on the dequantized codes, the only weight realize has, and simulate (QAT) computes
    the same (it read the float weight); weight-only realize crashed (the decoder took the
    encoder's layout, whose output axis it contracts)."""
    w = {"w": (RNG.normal(size=(12, 8)) / 3).astype(np.float32)}

    def tied(p, x):
        with jax.named_scope("enc"):
            h = jnp.tanh(x @ p["w"])
        with jax.named_scope("dec"):
            return h @ p["w"].T

    kw = dict(calibration=BATCHES, config=QConfig(activations=activations), progress=False)
    with pytest.warns(UserWarning, match=r"dec/dot_general: \['w'\] \(quantized for 'enc/"):
        real, sim = Q(tied, w, **kw), Q(tied, w, mode="simulate", **kw)
    np.testing.assert_allclose(real(X), sim(X), rtol=1e-5, atol=1e-6)
    assert [lay.status for lay in real.report().layers][0] == "quantized"
    g = jax.grad(lambda p: jnp.sum(sim.apply(p, X) ** 2))(w)["w"]
    assert np.isfinite(g).all() and np.abs(g).max() > 0


@pytest.mark.parametrize(
    "config",
    [
        QConfig(activations=None),
        QConfig(weights=Scheme(bits=4, granularity="channel"), activations=None),
        QConfig(dynamic=True),
        QConfig(dynamic=True, rules=(Rule(pattern="dot_general", weights=Scheme(bits=4)),)),
    ],
    ids=["w8", "w4", "dynamic", "dynamic-rule"],
)
def test_a_tied_table_read_before_its_layer_runs_in_simulate_as_realize_deploys_it(config):
    """A tied embedding: the lookup (not quantized) comes before the output projection that
    quantizes the table. Realize's lookup reads the dequantized codes; simulate read the float
    table, as the projection had not planned the leaf yet when the lookup was lowered (without
    a calibration pass to lower again: weight-only and dynamic configs): W4 differed by 1.4."""
    p = {"emb": RNG.normal(size=(50, 16)).astype(np.float32)}
    ids = RNG.integers(0, 50, size=(4, 8))

    def tied(p, ids):
        return p["emb"][ids] @ p["emb"].T

    kw = dict(calibration=[(ids,)], config=config, progress=False)
    real, sim = Q(tied, p, **kw), Q(tied, p, mode="simulate", **kw)
    np.testing.assert_allclose(real(ids), sim(ids), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sim.realize(p)(ids), sim(ids), rtol=1e-5, atol=1e-5)
    if config.activations is None:  # (weight-only: the deployed function in numpy)
        deq = np.asarray(real.params["emb"].dequantize())
        np.testing.assert_allclose(sim(ids), deq[ids] @ deq.T, rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda p: jnp.sum(sim.apply(p, ids) ** 2))(p)["emb"]
    assert np.isfinite(g).all() and np.abs(g).max() > 0


def test_float64_inputs_are_canonicalized_as_under_jit():
    qf = realized()
    x64 = X.astype(np.float64)
    np.testing.assert_array_equal(np.asarray(qf(x64)), np.asarray(qf(X)))
    np.testing.assert_array_equal(
        np.asarray(jaxq.trace(mlp, X)(x64)), np.asarray(jaxq.trace(mlp, X)(X))
    )


def test_the_typed_entry_point_has_the_functions_signature():
    import inspect

    from jaxq.quantize import Quantize
    from jaxq.quantize._api import quantize

    protocol = inspect.signature(Quantize.__call__)
    params = [p for name, p in protocol.parameters.items() if name != "self"]
    assert [(p.name, p.kind, p.default) for p in params] == [
        (p.name, p.kind, p.default) for p in inspect.signature(quantize).parameters.values()
    ]
    assert jaxq.quantize is quantize and "annotate, calibrate" in (jaxq.quantize.__doc__ or "")


def test_layers_under_remat_are_quantized_in_both_modes():
    """Gradient checkpointing (``jax.checkpoint``, Flax ``nn.remat``) is a call like ``jit``: the
    layers inside are quantized, and a QAT gradient flows through them. The remat and its policy
    stay around the quantized layers: inlined, a QAT gradient of four remat blocks saved 36x the
    activation bytes of float's."""
    policy = jax.checkpoint_policies.save_only_these_names("act")

    def f(p, x):
        block = jax.checkpoint(lambda p, x: checkpoint_name(x @ p["w1"], "act"), policy=policy)
        return jax.nn.relu(block(p, x)) @ p["w2"]

    params = {"w1": P["dense"][0]["kernel"], "w2": P["dense"][1]["weight"]}
    qf = Q(f, params, calibration=BATCHES, progress=False)
    assert all(isinstance(w, QArray) for w in qf.params.values())
    assert [lay.status for lay in qf.report().layers] == ["quantized"] * 2
    closure = Q(functools.partial(f, params), calibration=BATCHES, progress=False)
    np.testing.assert_array_equal(np.asarray(qf(X)), np.asarray(closure(X)))
    qs = Q(f, params, calibration=BATCHES, mode="simulate", progress=False)
    g = jax.grad(lambda p: jnp.sum(qs.apply(p, X) ** 2))(params)
    assert all(np.abs(np.asarray(v)).sum() > 0 for v in g.values())
    np.testing.assert_array_equal(np.asarray(qs.realize()(X)), np.asarray(qf(X)))
    for fn, p in ((qs.apply, params), (qf.apply, qf.params)):
        eqns = jaxq.trace(fn, p, X).equations()
        remats = [e for e in eqns if e.primitive in ("checkpoint", "remat2")]
        assert [e.params["policy"] for e in remats] == [policy]


def test_a_prng_key_among_the_params_passes_through():
    """Flax NNX state holds typed PRNG keys (``nnx.Rngs``) beside the weights."""

    def f(p, x):
        return x @ p["w"] + 0.0 * jax.random.normal(p["key"], (p["w"].shape[1],))

    params = {"w": P["dense"][0]["kernel"], "key": jax.random.key(0)}
    qf = Q(f, params, calibration=BATCHES, progress=False)
    assert isinstance(qf.params["w"], QArray)
    qp = qf.quantize_params(params)
    np.testing.assert_array_equal(np.asarray(qf.apply(qp, X)), np.asarray(qf(X)))


def test_an_export_taking_quantized_params_serializes(tmp_path):
    """``jax.export`` of ``jax.jit(qf.apply)`` round-trips through bytes (QArray is registered
    for export serialization), and a QuantizedFunction saves at another batch."""
    qf = realized()
    exported = jax.export.export(jax.jit(qf.apply))(qf.params, X)
    back = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(np.asarray(back.call(qf.params, X)), np.asarray(qf(X)))
    x3 = X[:3]
    loaded = jaxq.load(qf.save(tmp_path / "b3.jaxq", x3))
    np.testing.assert_array_equal(np.asarray(loaded(x3)), np.asarray(jax.jit(qf)(x3)))
    closure = closure_style(P)
    loaded = jaxq.load(closure.save(tmp_path / "c3.jaxq", x3))
    np.testing.assert_array_equal(np.asarray(loaded(x3)), np.asarray(jax.jit(closure)(x3)))


def test_export_with_a_symbolic_batch():
    """``jax.export`` with a shape-polymorphic batch: realize takes the route of many rows
    there (a symbolic batch may be large), equal to the jitted function from 2 rows on and
    within float rounding at one row (where the jitted one carries its sums in f32)."""
    qf = realized()
    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, X.shape[1]), jnp.float32)
    exported = jax.export.deserialize(
        jax.export.export(jax.jit(qf.apply))(qf.params, spec).serialize()
    )
    for n in (3, 6):
        np.testing.assert_array_equal(
            np.asarray(exported.call(qf.params, X[:n])), np.asarray(jax.jit(qf)(X[:n]))
        )
    np.testing.assert_allclose(
        np.asarray(exported.call(qf.params, X[:1])),
        np.asarray(jax.jit(qf)(X[:1])),
        rtol=1e-5,
        atol=1e-6,
    )


def test_simulate_with_gptq_on_params_warns_that_realize_differs():
    """GPTQ needs calibration data, so the simulation (which rounds the params it is given)
    cannot follow it: say so, rather than let ``apply`` and ``realize`` differ silently."""
    cfg = QConfig(weight_calibration="gptq")
    with pytest.warns(UserWarning, match=r"qs.realize\(params\)\(x\) differ"):
        Q(model, P, calibration=BATCHES, config=cfg, mode="simulate", progress=False)
    Q(model, P, calibration=BATCHES, config=cfg, progress=False)  # (realize: no warning)


def test_a_weight_reshaped_before_its_layer_is_named_with_the_fix():
    """Quantization follows a weight through transposes and casts only: a param reshaped on the
    way stays float, and the warning and the report name the param, the equation and the fix."""
    w = P["dense"][0]["kernel"].reshape(3, 4, 16)  # stored 3-D, used as [12, 16]
    with pytest.warns(UserWarning, match=r"dot_general \(params\['w'\] through reshape\)"):
        qf = Q(
            lambda p, x: x @ p["w"].reshape(12, 16), {"w": w}, calibration=BATCHES, progress=False
        )
    assert not isinstance(qf.params["w"], QArray)
    (layer,) = qf.report().layers
    assert (
        "reaches it through reshape" in layer.status
        and "Store the param" in layer.status
        and "partial" in layer.status
    )
    qkv = {"w": np.concatenate([w.reshape(12, 16)] * 2, axis=1)}  # (a fused projection, split:
    with pytest.warns(UserWarning, match=r"2 layer\(s\) stay float.*through split"):  # was
        qf = Q(  # "no weight operand", with no warning)
            lambda p, x: sum(x @ h for h in jnp.split(p["w"], 2, axis=1)),
            qkv,
            calibration=BATCHES,
            progress=False,
        )
    assert all("reaches it through split" in lay.status for lay in qf.report().layers)
    gates = {"i": w.reshape(12, 16), "f": w.reshape(12, 16)}  # (Flax's OptimizedLSTMCell joins
    with pytest.warns(UserWarning, match=r"through concatenate"):  # its gates' kernels)
        qf = Q(
            lambda p, x: x @ jnp.concatenate([p["i"], p["f"]], axis=1),
            gates,
            calibration=BATCHES,
            progress=False,
        )
    (layer,) = qf.report().layers
    assert "through concatenate" in layer.status and "flax.linen.LSTMCell" in layer.status


@pytest.mark.parametrize("loop", ["fori_loop", "python"])
def test_a_stack_indexed_per_layer_is_named_with_the_fix(loop):
    """``p["w"][i]`` in a ``fori_loop`` over layers stays float; it said "no weight operand
    (both are activations ...)", with no warning. A static slice in a Python loop said "Store
    the param in the shape the layer uses"; both now point to lax.scan over the stack."""
    stack = {"w": np.stack([P["dense"][1]["weight"]] * 3)}
    step = lambda p, i, x: jnp.tanh(x @ p["w"][i])  # noqa: E731
    if loop == "python":
        f = lambda p, x: step(p, 2, step(p, 1, step(p, 0, x)))  # noqa: E731
    else:
        f = lambda p, x: jax.lax.fori_loop(0, 3, lambda i, x: step(p, i, x), x)  # noqa: E731
    prim = "dynamic_slice" if loop == "fori_loop" else "slice"
    with pytest.warns(UserWarning, match=rf"params\['w'\] through {prim}\)"):
        qf = Q(
            f, stack, calibration=[(RNG.normal(size=(4, 16)).astype(np.float32),)], progress=False
        )
    assert not isinstance(qf.params["w"], QArray)
    for layer in qf.report().layers:
        assert f"reaches it through {prim}," in layer.status and "lax.scan" in layer.status


@pytest.mark.parametrize(
    ("form", "primitive"),
    [
        (lambda p, x: x @ (p["w"] * 2.0), "mul"),
        (lambda p, x: x @ (p["w"] + p["a"] @ p["b"]), "add"),  # (a LoRA-merged weight)
        (lambda p, x: x @ (p["w"] / 2.0), "div"),
        # weight standardization (jnp.std: reductions, and constants jit traces like values)
        (lambda p, x: x @ ((p["w"] - p["w"].mean(0)) / (p["w"].std(0) + 1e-5)), "sub"),
        # weight normalization (Flax's WeightNorm): a norm of the param, and a gain
        (lambda p, x: x @ (p["w"] / jnp.linalg.norm(p["w"], axis=0) * p["b"][0]), "div"),
        # a pruned or masked weight (the mask from iota: traced, computed from no input)
        (lambda p, x: x @ p["w"].at[0].set(0.0), "scatter"),
        (lambda p, x: x @ jnp.where(jnp.arange(12)[:, None] > 0, p["w"], 0.0), "select_n"),
        (lambda p, x: x @ jnp.pad(p["w"], ((0, 0), (0, 4)))[:, 4:], "pad"),
    ],
)
def test_a_weight_computed_from_params_is_named_not_called_an_activation(form, primitive):
    """A weight computed in f from params stays float; the report said "no weight operand (both
    are activations ...)" though the weight is in params."""
    w = {"w": P["dense"][0]["kernel"], "a": np.full((12, 2), 0.01, np.float32)}
    w["b"] = np.full((2, 16), 0.01, np.float32)
    with pytest.warns(UserWarning, match=rf"through {primitive}\)"):
        qf = Q(form, w, calibration=BATCHES, progress=False)
    (layer,) = [lay for lay in qf.report().layers if "reaches it through" in lay.status]
    assert f"reaches it through {primitive}" in layer.status and "outside f" in layer.status
    if primitive == "add":  # (the LoRA update a @ b itself said "both operands constant")
        (update,) = [lay for lay in qf.report().layers if lay.name == "dot_general"]
        assert update.status.startswith("both operands are params (['a'], ['b'])")


@pytest.mark.parametrize("form", ["add", "sub"])
def test_a_weight_updated_by_run_time_values_is_named_not_called_an_activation(form):
    """QLoRA written x @ (w + a @ b) with the adapters an argument: w stayed float with no
    warning, and the report blamed "no weight operand (both are activations ...)". A bias add
    (the param broadcast up to an activation's shape) is still an activation."""
    w = {"w": P["dense"][0]["kernel"], "bias": np.zeros(16, np.float32)}
    lora = {"a": np.full((12, 2), 0.01, np.float32), "b": np.full((2, 16), 0.01, np.float32)}
    op = jnp.add if form == "add" else jnp.subtract

    def f(p, lora, x):
        h = jnp.tanh(x @ op(p["w"], lora["a"] @ lora["b"]) + p["bias"])
        return h @ p["w"].T  # (w itself, quantized here)

    with pytest.warns(UserWarning, match=rf"through {form} with run-time values\)"):
        qf = Q(f, w, calibration=[(lora, BATCHES[0][0])], progress=False)
    (layer,) = [lay for lay in qf.report().layers if "reaches it through" in lay.status]
    assert "x @ w + (x @ a) @ b" in layer.status and "['w']" in layer.status
    assert isinstance(qf.params["w"], jaxq.QArray)  # (the other layer's)

    def cached(p, x):  # (a cache in params written at run time is no weight)
        return x @ lax.dynamic_update_slice(p["cache"], x * 2.0, (0, 0)).T

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qc = Q(cached, {"cache": np.zeros((6, 12), np.float32)}, calibration=BATCHES[:1])
    assert qc.report().layers[0].status.startswith("no weight operand")


def test_an_input_gradient_inside_f_says_why_its_backward_layers_stay_float():
    """A PINN's residual differentiates the net by its input inside f: the backward pass reads
    each weight transposed. The report blamed "another scheme" (with a Rule as the fix, which
    changed nothing) and called a weight times the unit cotangent "both operands are params";
    per-tensor weights with symmetric activations share one QArray in both directions."""
    p = [P["dense"][0]["kernel"][:2], np.full((16, 1), 0.2, np.float32)]
    net = lambda p, xy: (jnp.tanh(xy @ p[0]) @ p[1])[0]  # noqa: E731
    f = lambda p, x: jax.vmap(jax.grad(net, argnums=1), (None, 0))(p, x).sum(-1)  # noqa: E731
    x = RNG.uniform(size=(32, 2)).astype(np.float32)
    with pytest.warns(UserWarning, match="dequantized codes"):
        qf = Q(f, p, calibration=[(x,)], progress=False)
    status = {lay.name: lay.status for lay in qf.report().layers}
    unit, back = (status[f"vmap(transpose(jvp()))/{n}"] for n in ("dot_general", "dot_general_1"))
    assert unit.startswith("its operands are param [1] and a constant, no activation")
    assert "another layout (as a backward pass reads W transposed)" in back
    assert "scales run along other axes" in back and "code sums" in back
    config = QConfig(weights=Scheme(granularity="tensor"), activations=Scheme(symmetric=True))
    with pytest.warns(UserWarning, match="dequantized codes"):  # (the unit cotangent's)
        shared, sim = (
            Q(f, p, calibration=[(x,)], config=config, mode=mode, progress=False)
            for mode in ("realize", "simulate")
        )
    assert shared.report().layers[-1].status == "quantized"  # (the backward layer)
    np.testing.assert_allclose(shared(x), sim(x), rtol=1e-5, atol=1e-6)
    assert np.linalg.norm(shared(x) - f(p, x)) < 0.03 * np.linalg.norm(f(p, x))


@pytest.mark.parametrize("attention", [None, Scheme(granularity="token")])
def test_complex_matmuls_stay_float_and_say_why(attention):
    """An S4D / S5 layer multiplies complex values: int8 codes hold real ones. With
    ``attention=`` set, the complex x complex product was quantized as two activations and lost
    its imaginary part (relative error 1.0); a complex param was reported as "no weight operand"."""
    w = (P["dense"][0]["kernel"] * (1 + 0.5j)).astype(np.complex64)
    params = {"w": w, "v": P["dense"][1]["weight"]}

    def f(p, x):
        h = (x * jnp.exp(0.3j * x)) @ p["w"]
        return h.imag @ p["v"], h.real

    qf = Q(f, params, calibration=BATCHES, config=QConfig(attention=attention), progress=False)
    np.testing.assert_array_equal(qf(X)[1], f(params, X)[1])  # (the float layer, unchanged)
    cplx, real = qf.report().layers
    assert cplx.status.startswith("complex operands: stays float") and real.status == "quantized"


def test_calibration_in_the_wrong_form_says_what_a_batch_is():
    with pytest.raises(TypeError, match="iterable of argument tuples.*wrap each batch"):
        Q(model, P, calibration=X, progress=False)
    with pytest.raises(TypeError, match="got dict .*keyword arguments"):
        Q(model, P, calibration={"x": X}, progress=False)
    with pytest.raises(QuantizeError, match=r"first calibration batch, called as f\(params, \*b"):
        Q(model, P, calibration=[(P, X)], progress=False)  # (the params in the batch too)
    with pytest.raises(
        QuantizeError,
        match=r"(?s)need calibration data.*as calibration batches are: if they are the "
        r"batches, pass them by name",
    ):
        Q(model, BATCHES, progress=False)  # (the batches where the params go)
    d0 = P["dense"][0]
    layers = [(d0["kernel"], d0["bias"]), (np.ones((16, 4), np.float32),)]
    with pytest.raises(QuantizeError, match="need calibration data") as err:
        Q(lambda p, x: x @ p[0][0] @ p[1][0], layers, progress=False)  # (the README's layout)
    assert "calibration batches" not in str(err.value)
    two = lambda p, x, m: model(p, x) * m
    with pytest.raises(
        QuantizeError,
        match=r"this batch is a list, which f received as one "
        r"argument: if f takes several, write each batch as a tuple",
    ):
        Q(two, P, calibration=[[X, 1.0]], progress=False)
    assert Q(two, P, calibration=[(X, 1.0)], progress=False)(X, 1.0).shape  # (as a tuple)


def test_integer_inputs_of_a_mixed_dot_run_in_both_modes():
    """``x @ w`` with int32 ``x`` is a mixed-type dot in the jaxpr: realize quantized the int
    input's values, and simulate failed inside ("x must have a floating dtype")."""
    f = lambda p, x: x @ p["w"]
    w = {"w": P["dense"][0]["kernel"]}
    xi = np.round(X * 3).astype(np.int32)
    real = Q(f, w, calibration=BATCHES, progress=False)
    sim = Q(f, w, calibration=BATCHES, mode="simulate", progress=False)
    np.testing.assert_allclose(sim(xi), real(xi), rtol=1e-5, atol=1e-5)


def test_16_bit_float_layers_simulate_as_realize_computes_them():
    """A bfloat16 input reaches the first dot as it is (a mixed dot): simulate rounded the
    fake-quantized activation to bfloat16 (error 0.017 against realize, whose integer sums are
    exact); it computes such layers in float32 now, rounded once at the end."""
    f = lambda p, x: jax.nn.relu(x @ p["w1"]) @ p["w2"]
    w = {"w1": P["dense"][0]["kernel"], "w2": P["dense"][1]["weight"]}
    xb = jnp.asarray(X, jnp.bfloat16)
    real = Q(f, w, calibration=BATCHES, progress=False)
    sim = Q(f, w, calibration=BATCHES, mode="simulate", progress=False)
    np.testing.assert_allclose(sim(xb), real(xb), rtol=1e-5, atol=1e-5)
    # bfloat16 weights and outputs: within a bfloat16 step (realize chains the layers on int8
    # codes, where simulate rounds the hidden layer to bfloat16 as the float program does)
    w16 = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), w)
    cal16 = [(jnp.asarray(b, jnp.bfloat16),) for (b,) in BATCHES]
    real = Q(f, w16, calibration=cal16, progress=False)
    sim = Q(f, w16, calibration=cal16, mode="simulate", progress=False)
    yr, ys = np.float32(real(xb)), np.float32(sim(xb))
    assert np.abs(yr - ys).max() <= 2**-7 * np.abs(yr).max()


def test_tracing_at_new_shapes_keeps_no_tracer_alive():
    """The lowering's traced values (a QArray's activation scale per layer) are dropped as its
    trace ends; JAX's trace cache kept them alive, which jax.checking_leaks() reported."""
    qf, qs = realized(), simulated()
    with jax.checking_leaks():
        qf(X[:3])
        jax.jit(qf.apply)(qf.params, X[:5])
        jax.jit(jax.grad(lambda p: jnp.sum(qs.apply(p, X[:2]))))(P)


def test_quantize_params_inside_jit_says_it_runs_on_the_host():
    qf = realized()
    with pytest.raises(QuantizeError, match="traced values .* chosen on the host"):
        jax.jit(qf.quantize_params)(P)  # (JAX's TracerArrayConversionError, before)


def test_a_python_flag_that_cannot_be_traced_says_to_bind_it():
    def f(p, x, train=False):
        y = model(p, x)
        return y * 2 if train else y

    qf = Q(f, P, calibration=BATCHES, progress=False)
    with pytest.raises(jaxq.TraceError, match=r"Python values such as True too: bind flags"):
        qf(X, train=True)
    # (the same flag in the calibration batches: quantize pointed at lax.cond only)
    with pytest.raises(QuantizeError, match=r"Python values such as True too: bind flags"):
        Q(f, P, calibration=[(X, True)], progress=False)


def test_a_python_flag_among_the_params_is_named():
    """An Equinox module passed as params holds its Dropout's flags (p=0.1, inference=True):
    the error pointed at flat_args[3], not at the leaf or at the fix."""

    def f(p, x):
        y = model(p["layers"], x)
        return y if p["inference"] else y * 0.5

    with pytest.raises(
        Q.QuantizeError, match=r"Python values, not arrays \(\['inference'\]=True\).*eqx\.partition"
    ):
        Q(f, {"layers": P, "inference": True}, calibration=BATCHES, progress=False)


def test_arguments_f_cannot_trace_are_compared_with_the_calibration_ones():
    """A new shape is traced again through f; where f fails on it, the error names the shapes
    quantize saw and the ones given (before: only the model's own error)."""
    qf = Q(model, P, calibration=BATCHES, progress=False)
    with pytest.raises(
        jaxq.TraceError,
        match=r"(?s)dot_general.*f was quantized with arguments float32\[6,12\]; this call "
        r"gives int32\[6,7\]\. Other shapes are traced again",
    ):
        qf.apply(qf.params, np.ones((6, 7), np.int32))


def test_a_qarray_whose_scales_were_cast_is_named():
    """A tree.map that casts every float leaf also casts the QArrays' scales: named by path
    (the error said to trace a Program again)."""
    qf = realized()
    isq = lambda a: isinstance(a, QArray)
    cast = lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a
    p16 = jax.tree.map(lambda a: jax.tree.map(cast, a) if isq(a) else a, qf.params, is_leaf=isq)
    for run in (qf.apply, jax.jit(qf.apply)):
        with pytest.raises(QuantizeError, match=r"params\['dense'\]\[0\]\['kernel'\] is a QArray "):
            run(p16, X)
    # its codes too (int16 codes: the error said to trace a Program again for new shapes)
    wide = lambda a: a.astype(jnp.int16) if a.dtype == jnp.int8 else a
    c16 = jax.tree.map(lambda a: jax.tree.map(wide, a) if isq(a) else a, qf.params, is_leaf=isq)
    with pytest.raises(QuantizeError, match=r"\['kernel'\] is a QArray whose codes is int16"):
        qf.apply(c16, X)


def test_a_float_layer_reading_a_quantized_param_is_named():
    """A Rule keeps layer A float, but A shares its param with layer B, which is quantized: the
    params hold only B's codes, so A computes with them dequantized. The report said "skipped"
    and nothing more (A was 0.5% off float); now the status and a warning say so."""
    w = (RNG.normal(size=(12, 12)) / 4).astype(np.float32)

    def f(p, x):
        with jax.named_scope("A"):
            a = x @ p["w"]
        with jax.named_scope("B"):
            return a, jnp.tanh(a) @ p["w"]

    cfg = QConfig(rules=(Rule(pattern="^A/", skip=True),))
    with pytest.warns(UserWarning, match=r"A/dot_general: \['w'\] \(quantized for 'B/dot_general'"):
        qf = Q(f, {"w": w}, calibration=BATCHES, config=cfg, progress=False)
    (a,) = [r for r in qf.report().layers if r.name == "A/dot_general"]
    assert a.rule == 0 and "reads the dequantized ['w']" in a.status
    np.testing.assert_array_equal(qf(X)[0], X @ qf.params["w"].dequantize())


def test_a_rule_giving_one_layer_activations_in_a_weight_only_config_is_calibrated():
    """``QConfig(activations=None)`` with a Rule that gives one layer static activations: the
    calibration data was not run, and quantize said to "calibrate first"."""
    cfg = QConfig(
        activations=None, rules=(Rule(pattern="Dense_1", activations=Scheme(symmetric=False)),)
    )
    qf = Q(model, P, calibration=BATCHES, config=cfg, progress=False)
    acts = {r.name: r.activations for r in qf.report().layers}
    assert acts["Dense_1/dot_general"] == "int8 asym tensor static"
    assert sum(a is None for a in acts.values()) == len(acts) - 1
    sim = Q(model, P, calibration=BATCHES, config=cfg, mode="simulate", progress=False)
    np.testing.assert_allclose(qf(X), sim(X), rtol=1e-4, atol=1e-5)


def test_layers_in_custom_derivative_functions_say_why_they_stay_float():
    """A dense layer written as a custom_vjp function stays float, and said "inside a scan /
    while / cond body that no param enters" with a warning to pass the weights as params,
    which they were; then it said nothing, and the report named no param."""

    @jax.custom_vjp
    def dense(x, w):
        return x @ w

    dense.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))
    w = {"a": (RNG.normal(size=(12, 12)) / 4).astype(np.float32)}
    with pytest.warns(
        UserWarning, match=r"params enter custom_jvp .*custom_vjp_call reads \['a'\]"
    ):
        qf = Q(lambda p, x: dense(x, p["a"]), w, calibration=BATCHES, progress=False)
    (row,) = qf.report().layers
    assert row.status.startswith("inside a custom_jvp / custom_vjp function: stays float")

    # a loop inside one (odeint's solver) said the loop's reason; a linear solve's steps too
    @jax.custom_vjp
    def solver(x, w):
        return jax.lax.fori_loop(0, 2, lambda i, x: jnp.tanh(x @ w), x)

    solver.defvjp(lambda x, w: (solver(x, w), w), lambda w, g: (g, jnp.zeros_like(w)))
    with pytest.warns(UserWarning, match="params enter custom_jvp"):
        qf = Q(lambda p, x: solver(x, p["a"]), w, calibration=BATCHES, progress=False)
    (row,) = qf.report().layers
    assert "custom_vjp_call/scan/" in row.name and row.status.startswith("inside a custom_jvp")
    a = w["a"] + 4 * np.eye(12, dtype=np.float32)
    qf = Q(lambda p, x: jnp.linalg.solve(a, x.T) @ p["b"], {"b": w["a"][:6]}, calibration=[(X,)])
    steps = [lay for lay in qf.report().layers if "custom_linear_solve" in lay.name]
    assert steps and all(lay.status.startswith("inside a linear solve") for lay in steps)
    with warnings.catch_warnings():  # (a custom function with no layer: nothing to say)
        warnings.simplefilter("error")
        Q(lambda p, x: jax.nn.relu(x) @ p["a"], w, calibration=BATCHES, progress=False)


def test_a_custom_gradient_function_with_constants_inside_quantizes_around_it():
    """jnp.clip inside a custom_vjp (Keras' int8 Dense, a user's straight-through layer): its
    bounds were folded into array constants, which the custom function's body cannot take, and
    quantize raised RewriteError."""

    @jax.custom_gradient
    def clipped(x, w):
        return jnp.clip(x, -1, 1) @ w, lambda g: (g @ w.T, None)

    f = lambda p, x: clipped(x, p["w"]) @ p["v"]  # noqa: E731
    params = {"w": P["dense"][0]["kernel"], "v": P["dense"][1]["weight"]}
    with pytest.warns(UserWarning, match=r"custom_vjp_call reads \['w'\]"):
        qf = Q(f, params, calibration=BATCHES, progress=False)
    inner, outer = qf.report().layers
    assert inner.status.startswith("inside a custom_jvp") and outer.status == "quantized"
    np.testing.assert_allclose(qf(X), f(params, X), rtol=0.05, atol=0.05)


def test_a_function_that_never_reads_its_params_is_named():
    # (a Hugging Face Flax model called as model(x), not model(x, params=p), uses its own
    # weights: nothing was quantized as params and new params changed nothing, without a word)
    with pytest.warns(UserWarning, match=r"never reads the params it is given.*params=p"):
        qf = Q(lambda p, x: model(P, x), P, calibration=BATCHES, progress=False)
    leaves = jax.tree.leaves(qf.params, is_leaf=lambda v: isinstance(v, QArray))
    assert leaves and not any(isinstance(leaf, QArray) for leaf in leaves)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (reading some of the params is fine)
        Q(lambda p, x: model(dict(P, head=p["head"]), x), P, calibration=BATCHES, progress=False)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize(
    "config", [QConfig(), QConfig(weights=Scheme(bits=4, granularity="channel"), activations=None)]
)
def test_a_weight_flipped_on_its_way_is_quantized_like_the_flipped_param(axis, config):
    # a kernel reversed before its layer (a ConvTranspose(transpose_kernel=True)'s spatial flip)
    # stayed float; along the channels the scales flip with it
    w = P["dense"][0]["kernel"]
    flipped = Q(
        lambda p, x: x @ jnp.flip(p["w"], axis),
        {"w": w},
        calibration=BATCHES,
        config=config,
        progress=False,
    )
    stored = Q(
        lambda p, x: x @ p["w"],
        {"w": np.flip(w, axis)},
        calibration=BATCHES,
        config=config,
        progress=False,
    )
    assert isinstance(flipped.params["w"], QArray)
    np.testing.assert_array_equal(
        flipped.params["w"].dequantize(), np.flip(stored.params["w"].dequantize(), axis)
    )
    x = BATCHES[0][0]
    np.testing.assert_allclose(
        jax.jit(flipped.apply)(flipped.params, x), stored(x), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_a_weight_only_function_differentiates_in_its_inputs(bits):
    # no value computed from the inputs is rounded, so its derivative is the float function's on
    # the dequantized weights (classifier guidance through a weight-only model); it raised
    mlp = lambda p, x: jnp.tanh(x @ p["w1"]) @ p["w2"].T
    params = {"w1": P["dense"][0]["kernel"], "w2": P["dense"][1]["weight"]}
    config = QConfig(weights=Scheme(bits=bits, granularity="channel"), activations=None)
    qf = Q(mlp, params, example_args=(X,), config=config, progress=False)
    deq = {k: v.dequantize() for k, v in qf.params.items()}
    want = jax.grad(lambda x: mlp(deq, x).sum())(X)
    got = jax.jit(jax.grad(lambda x: qf.apply(qf.params, x).sum()))(X)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


PIECE_CONFIGS = {
    "w8": QConfig(activations=None),
    "w8-asym": QConfig(activations=None, weights=Scheme(symmetric=False)),
    "w4-group": QConfig(
        activations=None, weights=Scheme(bits=4, granularity="group", group_size=32)
    ),
    "w4-group-asym": QConfig(
        activations=None,
        weights=Scheme(bits=4, granularity="group", group_size=128, symmetric=False),
    ),
    "w4a8": QConfig(weights=Scheme(bits=4)),
    "w8a8": QConfig(),
    "w8a8-group": QConfig(weights=Scheme(granularity="group", group_size=64)),
}


@pytest.mark.xla_cpu
@pytest.mark.parametrize("config", PIECE_CONFIGS.values(), ids=PIECE_CONFIGS.keys())
def test_few_rows_dequantize_their_weights_in_pieces(config):
    """At batch 1, a float-dequantized weight (weight-only, groups) was written out whole on
    every call (4096 x 4096: 0.1x float's speed); it is now dequantized 128 contracted rows at a
    time in a loop. Kernels [in, out] and [out, in] (x @ w.T), int4 packed along the contracted
    axis evenly (1024), unevenly (384: unpacked), and along another axis; the outputs are those
    of the whole weight, and exact integer sums stay exact (equal): carried in f32, or where
    1024 int8 products could pass 2**24 (W8A8), each piece's added in int32."""
    rng = np.random.default_rng(12)
    params = {
        "w1": rng.normal(size=(1024, 384)).astype(np.float32) / 30,
        "w2": rng.normal(size=(384, 512)).astype(np.float32) / 20,
        "wt": rng.normal(size=(256, 512)).astype(np.float32) / 20,
    }
    f = lambda p, x: (jax.nn.gelu(x @ p["w1"]) @ p["w2"]) @ p["wt"].T
    x = rng.normal(size=(1, 1024)).astype(np.float32)
    qf = Q(f, params, calibration=[(x,)], config=config, progress=False)
    whole = dataclasses.replace(Q.tuning(platform="cpu"), weight_pieces=0)
    with PassContext(config={"quantize.tuning": whole}):
        want = jax.jit(qf.apply)(qf.params, x)
        assert "scan[" not in str(jax.make_jaxpr(qf.apply)(qf.params, x))
    assert str(jax.make_jaxpr(qf.apply)(qf.params, x)).count("scan[") == 3
    got = jax.jit(qf.apply)(qf.params, x)
    if config.activations is not None and config.weights.granularity != "group":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    sim = Q(f, params, calibration=[(x,)], config=config, mode="simulate", progress=False)
    np.testing.assert_allclose(got, sim(x), rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    # closed over, the weights are constants XLA converts once when it compiles: dequantized
    # whole, no loop (in pieces, bench_quantize's MLP at batch 1 ran 0.81x float's speed)
    closed = Q(functools.partial(f, params), calibration=[(x,)], config=config, progress=False)
    assert "scan[" not in str(jax.make_jaxpr(closed)(x))
    np.testing.assert_allclose(
        jax.jit(closed)(x), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max())
    )


VALUE_KEEPING = {
    "stop_gradient": jax.lax.stop_gradient,
    "with_sharding_constraint": lambda w: jax.lax.with_sharding_constraint(
        w, jax.sharding.SingleDeviceSharding(jax.devices()[0])
    ),
    "device_put": jax.device_put,
    "optimization_barrier": jax.lax.optimization_barrier,
    "checkpoint_name": lambda w: checkpoint_name(w, "kernel"),
}


@pytest.mark.parametrize("op", VALUE_KEEPING.values(), ids=VALUE_KEEPING.keys())
def test_a_weight_through_a_value_keeping_equation_is_quantized(op):
    """A frozen layer (stop_gradient), a sharding constraint, device_put, a barrier or a remat
    name between a param and its matmul left the weight float, its report saying "no weight
    operand" (found by a helper). Quantized like the bare weight; QAT keeps the op's meaning."""
    w = P["dense"][0]["kernel"]
    bare = Q(lambda p, x: x @ p["w"], {"w": w}, calibration=BATCHES, progress=False)
    f = lambda p, x: x @ op(p["w"])
    qf = Q(f, {"w": w}, calibration=BATCHES, progress=False)
    assert isinstance(qf.params["w"], QArray)
    assert qf.report().layers[0].param == "['w']"
    np.testing.assert_array_equal(jax.jit(qf.apply)(qf.params, X), bare(X))
    qs = Q(f, {"w": w}, calibration=BATCHES, mode="simulate", progress=False)
    g = jax.grad(lambda p: qs.apply(p, X).sum())({"w": w})["w"]
    assert (np.abs(g).max() == 0) == (op is jax.lax.stop_gradient)


def test_a_bfloat16_layer_simulates_the_integers_realize_computes():
    """Simulate rounded a bf16 layer's fake-quantized weight (codes x scales) to bf16 before its
    f32 product, so 45% of outputs differed from realize's by a bf16 ulp (a helper); the
    weight's simulated value is now the f32 one realize's integer sums stand for. (Op by op:
    under jit, XLA:CPU divides by a scalar as a multiply by its reciprocal, which moves a code
    at a near-tie, and drops f32 -> bf16 -> f32 round trips, excess precision it allows.)"""
    rng = np.random.default_rng(13)
    p = {"w": jnp.asarray(rng.normal(size=(32, 32)) / np.sqrt(32), jnp.bfloat16)}
    xs = [(jnp.asarray(rng.normal(size=(8, 32)), jnp.bfloat16),) for _ in range(3)]
    f = lambda p, x: x @ p["w"]
    qf = Q(f, p, calibration=xs, progress=False)
    qs = Q(f, p, calibration=xs, mode="simulate", progress=False)
    np.testing.assert_array_equal(qs.apply(p, xs[0][0]), qf.apply(qf.params, xs[0][0]))


def test_an_empty_weight_stays_float_with_its_reason():
    """A (16, 0) param in a matmul (an empty head) failed annotate with a ZeroDivisionError."""
    p = {"w": P["dense"][0]["kernel"], "empty": np.zeros((12, 0), np.float32)}
    f = lambda p, x: jnp.concatenate([x @ p["w"], x @ p["empty"]], axis=1)
    qf = Q(f, p, calibration=BATCHES, progress=False)
    assert isinstance(qf.params["w"], QArray) and not isinstance(qf.params["empty"], QArray)
    assert "size-0" in qf.report().layers[-1].status
    np.testing.assert_array_equal(qf(X)[:, 16:], np.zeros((len(X), 0)))


def test_sparse_matmuls_are_listed_as_float_with_their_param():
    """A BCOO weight or a sparsified function (jax.experimental.sparse) ran float and its matmul
    was missing from the report, with no warning."""
    from jax.experimental import sparse

    w = P["dense"][0]["kernel"] * (RNG.random((12, 16)) < 0.3)
    params = {"ws": sparse.BCOO.fromdense(w), "v": P["dense"][1]["weight"]}
    f = lambda p, x: jnp.tanh(x @ p["ws"]) @ p["v"]  # noqa: E731
    qf = Q(f, params, calibration=BATCHES, progress=False)
    rows = {row.primitive: row for row in qf.report().layers}
    assert rows["bcoo_dot_general"].status.startswith("a sparse matmul (jax.experimental.sparse)")
    assert rows["bcoo_dot_general"].param.startswith("['ws']")  # (its data)
    assert rows["dot_general"].status == "quantized"
    ref = f(params, jnp.asarray(X))
    assert np.linalg.norm(qf(X) - ref) < 0.05 * np.linalg.norm(ref)
