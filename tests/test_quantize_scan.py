"""Layer stacks under ``lax.scan``: stacked weights quantized per layer, calibrated per iteration."""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from strategies import examples

from jaxq import quantize as Q
from jaxq.quantize import QArray, QConfig, QuantizeError, Scheme
from jaxq.quantize._qarray import is_qarray
from jaxq.quantize._report import sqnr_db
from jaxq.quantize._state import get_state

D, H = 8, 12


def make_params(rng, layers, spread=1.0):
    """A stack of MLP blocks whose layer ``i`` has weights ``spread ** i`` times the first's."""
    gain = spread ** np.arange(layers, dtype=np.float32)
    w1 = rng.normal(size=(layers, D, H)).astype(np.float32) * gain[:, None, None] / 3
    w2 = rng.normal(size=(layers, H, D)).astype(np.float32) / 4
    return {"stack": {"w1": w1, "w2": w2}, "head": rng.normal(size=(D, 3)).astype(np.float32)}


def block(carry, p):
    x, total = carry
    y = jax.nn.relu(x @ p["w1"]) @ p["w2"]
    return (x + y, total + y.sum()), y


def scanned(reverse, params, x):
    (x, total), ys = jax.lax.scan(block, (x, jnp.float32(0)), params["stack"], reverse=reverse)
    return x @ params["head"], total, ys


def unrolled(reverse, params, x):
    """The same model with one param leaf per layer (no scan): each layer quantized alone."""
    carry, ys = (x, jnp.float32(0)), {}
    n = len(params["layers"])
    for i in reversed(range(n)) if reverse else range(n):
        with jax.named_scope(f"layer_{i}"):
            carry, ys[i] = block(carry, params["layers"][i])
    x, total = carry
    return x @ params["head"], total, jnp.stack([ys[i] for i in range(n)])


def per_layer(params):
    s = params["stack"]
    n = s["w1"].shape[0]
    return {
        "layers": [{"w1": s["w1"][i], "w2": s["w2"][i]} for i in range(n)],
        "head": params["head"],
    }


def batches(rng, n=2, rows=5, shift=0.0):
    return [((rng.normal(size=(rows, D)) + shift).astype(np.float32),) for _ in range(n)]


@settings(max_examples=examples(5), deadline=None)
@given(
    st.integers(1, 4),  # layers
    st.booleans(),  # reverse
    st.booleans(),  # asymmetric activations
    st.sampled_from(["tensor", "channel"]),
    st.integers(0, 2**16),
)
def test_a_scanned_stack_equals_its_unrolled_layers_quantized_alone(
    layers, reverse, asym, gran, seed
):
    """Each iteration's slice is quantized as that layer alone would be (its own weight scales
    and calibrated activation scale): realize gives exactly the unrolled model's results
    (integer dots; simulate's float dots may round apart inside a loop), and agrees with
    simulate."""
    rng = np.random.default_rng(seed)
    params = make_params(rng, layers, spread=rng.uniform(1, 10))
    cal = batches(rng, shift=rng.uniform(-1, 1))
    x = cal[0][0][:3]
    cfg = QConfig(
        weights=Scheme(granularity=gran), activations=Scheme(symmetric=not asym, signed=True)
    )
    run = lambda f, p, mode: Q(f, p, calibration=cal, config=cfg, mode=mode, progress=False)
    out = {}
    for mode in ("realize", "simulate"):
        got = run(functools.partial(scanned, reverse), params, mode)
        want = run(functools.partial(unrolled, reverse), per_layer(params), mode)
        out[mode] = got(x)
        for a, b in zip(jax.tree.leaves(out[mode]), jax.tree.leaves(want(x)), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            if mode == "realize":
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
        if mode == "realize":  # stacked codes and scales: each layer's own
            stack = got.params["stack"]
            assert stack["w1"].shape == (layers, D, H)
            assert np.shape(stack["w1"].act_scale) == (layers,)
            for i, alone in enumerate(want.params["layers"]):
                np.testing.assert_array_equal(stack["w1"].codes[i], alone["w1"].codes)
                np.testing.assert_array_equal(
                    np.ravel(stack["w1"].scale[i]), np.ravel(alone["w1"].scale)
                )
                assert float(stack["w2"].act_scale[i]) == float(alone["w2"].act_scale)
    ref = np.asarray(scanned(reverse, params, x)[0])
    y_r, y_s = (np.asarray(out[m][0]) for m in ("realize", "simulate"))
    np.testing.assert_allclose(y_r, y_s, rtol=1e-5, atol=1e-5 * np.abs(y_s).max())
    assert sqnr_db(ref, y_r) > 15


def test_layers_a_hundred_times_apart_keep_their_own_scales():
    rng = np.random.default_rng(0)
    params = make_params(rng, 3, spread=10.0)  # layer 2's first weights: 100x layer 0's
    cal = batches(rng, n=3, rows=16)
    qf = Q(functools.partial(scanned, False), params, calibration=cal, progress=False)
    w1 = qf.params["stack"]["w1"]
    ratio = np.asarray(w1.scale).max(axis=(1, 2))
    assert 50 < ratio[2] / ratio[0] < 200  # per-layer weight scales
    state = get_state(qf.program, "test")
    a = [state.act[f"scan/dot_general_1@{i}"].scale for i in range(3)]
    assert a[2] / a[0] > 20  # per-iteration activation scales (the second matmul's inputs)
    # each layer's output as accurate (within 3 dB) as that layer quantized alone
    x = batches(rng, n=1, rows=16)[0][0]
    ys_float = np.asarray(scanned(False, params, x)[2])
    ys_q = np.asarray(qf(x)[2])
    alone = Q(
        functools.partial(unrolled, False), per_layer(params), calibration=cal, progress=False
    )
    ys_alone = np.asarray(alone(x)[2])
    for i in range(3):
        got, want = sqnr_db(ys_float[i], ys_q[i]), sqnr_db(ys_float[i], ys_alone[i])
        assert got > 20 and got >= want - 3, (i, got, want)
    rows = {r.name: r for r in qf.report(sample=(x,)).layers}
    row = rows["scan/dot_general"]
    assert row.status == "quantized" and row.in_loop == "scan"
    assert "static" in row.activations and row.layers == 3
    assert len(row.layer_sqnr_db) == 3 and row.sqnr_db == min(row.layer_sqnr_db)
    # each iteration's calibrated scale (the table's "a scale" column was blank for a stack)
    second = rows["scan/dot_general_1"]
    assert second.layer_activation_scale == tuple(float(v) for v in a)
    assert f"{min(a):.3g}..{max(a):.3g}" in str(qf.report())


def test_loop_constants_and_qat_through_a_stack():
    """A weight every iteration reads (a loop constant) gets one scale, its activations pooled
    over iterations; in simulate mode jax.grad reaches the stacked and the constant params."""
    rng = np.random.default_rng(1)
    params = make_params(rng, 2)
    params["shared"] = (rng.normal(size=(D, D)) / 3).astype(np.float32)

    def f(params, x):
        def body(c, p):
            c = c + jnp.tanh(c @ params["shared"]) + jax.nn.relu(c @ p["w1"]) @ p["w2"]
            return c, None

        return jax.lax.scan(body, x, params["stack"])[0] @ params["head"]

    cal = batches(rng, n=2)
    qf = Q(f, params, calibration=cal, progress=False)
    x = cal[1][0]
    shared = qf.params["shared"]
    assert isinstance(shared, QArray) and np.shape(shared.act_scale) == ()
    ref = np.asarray(f(params, x))
    np.testing.assert_allclose(
        np.asarray(jax.jit(qf.apply)(qf.params, x)), ref, atol=0.05 * np.abs(ref).max()
    )
    sim = Q(f, params, calibration=cal, mode="simulate", progress=False)
    grads = jax.grad(lambda p: jnp.sum(sim.apply(p, x) ** 2))(params)
    assert all(float(np.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    assert np.shape(grads["stack"]["w1"]) == (2, D, H)
    batched = jax.vmap(qf, in_axes=1, out_axes=1)(np.stack([x, x], axis=1))
    np.testing.assert_array_equal(np.asarray(batched[:, 0]), np.asarray(qf(x)))


def test_params_with_another_number_of_layers_are_refused_by_path():
    rng = np.random.default_rng(2)
    params = make_params(rng, 3)
    qf = Q(functools.partial(scanned, False), params, calibration=batches(rng), progress=False)
    fewer = make_params(rng, 2)
    with pytest.raises(QuantizeError, match=r"\['stack'\]\['w1'\]: expected float32\[3,8,12\]"):
        qf.quantize_params(fewer)


# ---- Flax layer stacks (params as arguments) ---------------------------------------------------

XF = np.random.default_rng(3).normal(size=(4, D)).astype(np.float32)
CALF = [(np.random.default_rng(i).normal(size=(64, D)).astype(np.float32),) for i in range(3)]


def check_stack(qf, reference, names):
    rows = {r.name: r for r in qf.report(sample=(XF,)).layers}
    for name in names:
        row = rows[name]
        assert row.status == "quantized" and row.layers == 3 and min(row.layer_sqnr_db) > 18
    ref = np.asarray(reference(XF))
    assert sqnr_db(ref, np.asarray(jax.jit(qf.apply)(qf.params, XF))) > 18


def test_a_linen_nn_scan_stack_is_quantized_per_layer():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.relu(nn.Dense(H)(x))
            return x + nn.Dense(D)(h), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
            )
            x, _ = stack(name="stack")(x, None)
            return nn.Dense(2)(x)

    model = Model()
    params = model.init(jax.random.key(0), XF)
    qf = Q(model.apply, params, calibration=CALF, progress=False)
    kernel = qf.params["params"]["stack"]["Dense_0"]["kernel"]
    assert isinstance(kernel, QArray) and kernel.shape == (3, D, H)
    assert np.shape(kernel.scale) == (3, 1, H) and np.shape(kernel.act_scale) == (3,)
    check_stack(
        qf,
        lambda x: model.apply(params, x),
        ["Model/scan/stack/Dense_0/dot_general", "Model/scan/stack/Dense_1/dot_general"],
    )


def test_an_nnx_scan_stack_is_quantized_per_layer():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, H, rngs=rngs)
            self.down = nnx.Linear(H, D, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.relu(self.up(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return Block(rngs)

            self.blocks = create(rngs)
            self.head = nnx.Linear(D, 2, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def step(block, x):
                return block(x)

            return self.head(step(self.blocks, x))

    model = Model(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    qf = Q(lambda s, x: nnx.merge(graphdef, s)(x), state, calibration=CALF, progress=False)
    stacked = [
        q
        for q in jax.tree.leaves(qf.params, is_leaf=lambda v: isinstance(v, QArray))
        if isinstance(q, QArray) and q.shape[0] == 3
    ]
    assert len(stacked) == 2
    # (named like the model: nnx.merge while tracing scopes the module it builds, and the copy
    # nnx.scan calls takes its original's path)
    check_stack(
        qf, model, ["Model/scan/blocks/up/dot_general", "Model/scan/blocks/down/dot_general"]
    )


@pytest.mark.xla_cpu
def test_a_decode_loop_over_a_layer_stack_is_quantized():
    """A scan over steps (weights as its constants) around a scan over layers (stacked): both
    levels are quantized; the step loop's layer is calibrated over all steps."""
    rng = np.random.default_rng(4)
    params = make_params(rng, 3)
    params["out"] = (rng.normal(size=(D, D)) / 3).astype(np.float32)

    def generate(params, x):
        def step(h, _):
            (h, _), _ = jax.lax.scan(block, (h, jnp.float32(0)), params["stack"])
            h = jnp.tanh(h @ params["out"])
            return h, h.sum(-1)

        return jax.lax.scan(step, x, None, length=4)

    cal = batches(rng, n=3, rows=16)
    x = cal[0][0]
    qf = Q(generate, params, calibration=cal, progress=False)
    sim = Q(generate, params, calibration=cal, mode="simulate", progress=False)
    rows = {r.name: r for r in qf.report(sample=(x,)).layers}
    assert rows["scan/dot_general"].layers == 0 and rows["scan/dot_general"].sqnr_db > 20
    for name in ("scan/scan/dot_general", "scan/scan/dot_general_1"):
        assert rows[name].status == "quantized" and rows[name].layers == 3
        assert len(rows[name].layer_sqnr_db) == 3
    int_dots = [
        e
        for e in qf.specialize(x).equations()
        if e.primitive == "dot_general" and e.params["preferred_element_type"] == jnp.int32
    ]
    assert len(int_dots) == 3 and all(len(e.path) > 1 for e in int_dots)  # inside the loops
    h, sums = jax.jit(qf.apply)(qf.params, x)
    h_sim, _ = sim(x)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_sim), rtol=1e-5, atol=1e-5)
    assert sqnr_db(np.asarray(generate(params, x)[0]), np.asarray(h)) > 20


def rnn_layer(w, xs):
    """A recurrent layer: a scan over time steps with the layer's weights as its constants."""

    def step(h, x):
        h = jnp.tanh(x @ w["wx"] + h @ w["wh"])
        return h, h

    return jax.lax.scan(step, jnp.zeros(xs.shape[1:-1] + (H,)), xs)[1]


@pytest.mark.parametrize("layers, steps", [(3, 3), (2, 4)])
def test_a_stack_of_time_loops_is_calibrated_per_layer_over_all_steps(layers, steps):
    # the time loop's statistics came out keyed name@step@layer, read as name@layer@step: a
    # KeyError where steps > layers, and where steps == layers each step used one layer's scales
    rng = np.random.default_rng(5)
    params = {
        "wx": (rng.normal(size=(layers, H, H)) / 3).astype(np.float32),
        "wh": (rng.normal(size=(layers, H, H)) / 3).astype(np.float32),
    }
    stacked = lambda p, xs: jax.lax.scan(lambda v, w: (rnn_layer(w, v), None), xs, p)[0]

    def unrolled(p, xs):
        for i, w in enumerate(p):
            with jax.named_scope(f"layer_{i}"):
                xs = rnn_layer(w, xs)
        return xs

    cal = [(rng.normal(size=(steps, 4, H)).astype(np.float32),) for _ in range(2)]
    qf = Q(stacked, params, calibration=cal, progress=False)
    alone = Q(unrolled, [jax.tree.map(lambda a, i=i: a[i], params) for i in range(layers)],
              calibration=cal, progress=False)  # fmt: skip
    x = cal[0][0]
    np.testing.assert_allclose(qf(x), alone(x), rtol=1e-5, atol=1e-5)
    scales = [r.layer_activation_scale for r in qf.report().layers if r.name.endswith("_1")]
    expected = [r.activation_scale for r in alone.report().layers if r.name.endswith("_1")]
    np.testing.assert_allclose(np.ravel(scales), np.ravel(expected), rtol=1e-6)


def test_stacked_params_shard_by_channel_and_save(tmp_path):
    from jax.sharding import Mesh

    import jaxq

    rng = np.random.default_rng(5)
    params = make_params(rng, 4)
    cal = batches(rng, n=2, rows=8)
    qf = Q(functools.partial(scanned, False), params, calibration=cal, progress=False)
    x = cal[0][0]
    w1 = qf.params["stack"]["w1"]
    assert w1.layers == 4 and "layers=4" in repr(w1)
    mesh = Mesh(np.array(jax.devices()[:4]), ("model",))
    shardings = jaxq.param_shardings(qf.params, mesh, "model")
    specs = [s.spec for s in jax.tree.leaves(shardings["stack"]["w1"])]
    assert specs[0] == jax.sharding.PartitionSpec(None, None, "model")  # each layer's channels
    sharded = jax.device_put(qf.params, shardings)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(qf.apply)(sharded, x)[0]), np.asarray(qf(x)[0])
    )
    loaded = jaxq.load(qf.save(tmp_path / "stack.jaxq"))
    for a, b in zip(jax.tree.leaves(loaded(x)), jax.tree.leaves(qf(x)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "config",
    [
        QConfig(
            weights=Scheme(bits=4, granularity="channel"),
            activations=None,
            weight_calibration="gptq",
        ),
        QConfig(
            weights=Scheme(bits=4, granularity="channel"),
            activations=None,
            weight_calibration="awq",
        ),
        QConfig(smoothing=0.5),
    ],
    ids=["gptq", "awq", "smoothquant"],
)
def test_data_driven_weight_methods_work_per_layer_of_a_stack(config):
    """GPTQ's ``X^T X``, AWQ's and SmoothQuant's factors are collected per iteration: each layer
    of the stack gets the codes (and factors) it would get quantized alone, exactly."""
    rng = np.random.default_rng(9)
    params = make_params(rng, 3, spread=3.0)
    cal = batches(rng, n=3, rows=16)
    x = cal[0][0]
    got = Q(
        functools.partial(scanned, False), params, calibration=cal, config=config, progress=False
    )
    want = Q(
        functools.partial(unrolled, False),
        per_layer(params),
        calibration=cal,
        config=config,
        progress=False,
    )
    info = get_state(got.program, "test").calibration
    layers = {"gptq": "gptq_layers", "awq": "awq_layers"}.get(
        config.weight_calibration, "smoothed_layers"
    )
    assert info[layers] == get_state(want.program, "test").calibration[layers] == 7  # 3 x 2 + head
    for i, alone in enumerate(want.params["layers"]):
        for k in ("w1", "w2"):
            np.testing.assert_array_equal(
                np.asarray(got.params["stack"][k].codes[i]), np.asarray(alone[k].codes)
            )
    for a, b in zip(jax.tree.leaves(got(x)), jax.tree.leaves(want(x)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_a_tied_table_read_as_floats_is_not_smoothed():
    """A table that an embedding lookup reads as floats and a smoothed matmul reads as its
    weight (a tied output projection) keeps codes of the weight itself (not ``s W``)."""
    rng = np.random.default_rng(10)
    params = {"emb": rng.normal(size=(20, D)).astype(np.float32)}

    def lm(params, ids):
        h = jnp.tanh(params["emb"][ids] * 2)
        return h @ params["emb"].T

    cal = [(rng.integers(0, 20, size=(4, 6)),) for _ in range(3)]
    ids = cal[0][0]
    ref = np.asarray(lm(params, ids))
    for config in (QConfig(smoothing=0.5), QConfig(activations=None, weight_calibration="awq")):
        qf = Q(lm, params, calibration=cal, config=config, progress=False)
        assert not get_state(qf.program, "test").smooth
        assert sqnr_db(ref, np.asarray(qf(ids))) > 25


@pytest.mark.xla_cpu
def test_while_loops_and_branches_that_read_params_are_quantized():
    """A ``fori_loop`` with a traced trip count (a while loop) and a ``cond``: their layers get
    int8 weights and static activation scales pooled over every iteration / the branches taken
    (a loop that ran no iteration, a branch never taken add nothing); realize agrees with
    simulate."""
    rng = np.random.default_rng(11)
    params = {k: (rng.normal(size=(D, D)) / 3).astype(np.float32) for k in ("w", "a", "b")}

    def f(params, x, n):
        h = jax.lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ params["w"]) + h, x)
        return jax.lax.cond(
            n > 2, lambda h: h @ params["a"], lambda h: jax.nn.relu(h @ params["b"]), h
        )

    cal = [(rng.normal(size=(4, D)).astype(np.float32), np.int32(k)) for k in (0, 3, 4)]
    x, n = cal[1]
    qf = Q(f, params, calibration=cal, progress=False)
    sim = Q(f, params, calibration=cal, mode="simulate", progress=False)
    rows = {r.name: r for r in qf.report().layers}
    for name in ("while/body/dot_general", "cond/branch0/dot_general", "cond/branch1/dot_general"):
        assert rows[name].status == "quantized" and "static" in rows[name].activations, name
    assert all(isinstance(v, QArray) for v in jax.tree.leaves(qf.params, is_leaf=is_qarray))
    int_dots = [
        e
        for e in qf.specialize(x, n).equations()
        if e.primitive == "dot_general" and e.params["preferred_element_type"] == jnp.int32
    ]
    assert len(int_dots) == 3
    # branch 1 (n > 2) saw n = 3 and 4 only; the loop's input pooled over 7 iterations
    state = get_state(qf.program, "test")
    h, hs = cal[1][0], []
    for k in (3, 4):
        h = cal[2 if k == 4 else 1][0]
        for _ in range(k):
            hs.append(h)
            h = np.tanh(h @ params["w"]) + h
    lo, hi = min(float(v.min()) for v in hs), max(float(v.max()) for v in hs)
    loop = state.act["while/body/dot_general"]
    assert np.isclose(loop.scale, (hi - lo) / 255, rtol=1e-3)
    for k in ((x, n), cal[2], cal[0]):
        y = np.asarray(jax.jit(qf.apply)(qf.params, *k))
        np.testing.assert_allclose(y, np.asarray(sim(*k)), rtol=1e-5, atol=1e-5)
        assert sqnr_db(np.asarray(f(params, *k)), y) > 30


@settings(max_examples=examples(5), deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=3),  # trip counts of the batches
    st.integers(0, 2),  # which branch of a three-way switch
    st.booleans(),  # asymmetric activations
    st.integers(0, 2**16),
)
def test_random_while_and_switch_programs_realize_like_simulate(trips, branch, asym, seed):
    """A while loop (traced trip count) carrying two values around a three-way switch, every
    layer's weight a param: realize agrees with simulate for any trip count and branch, and
    only the branches the calibration took get a static scale."""
    rng = np.random.default_rng(seed)
    params = {k: (rng.normal(size=(D, D)) / 3).astype(np.float32) for k in ("w", "a", "b", "c")}

    def f(params, x, n, k):
        def body(c):
            i, h, acc = c
            h = jnp.tanh(h @ params["w"]) + h
            return i + 1, h, acc + h.sum()

        _, h, acc = jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x, 0.0))
        branches = [lambda h, w=params[w]: jax.nn.relu(h @ w) for w in "abc"]
        return jax.lax.switch(k, branches, h), acc

    cal = [
        (rng.normal(size=(3, D)).astype(np.float32), np.int32(n), np.int32(branch)) for n in trips
    ]
    cfg = QConfig(activations=Scheme(symmetric=not asym, signed=True))
    with pytest.warns(UserWarning, match=r"never reached .*computed at run time"):
        qf = Q(f, params, calibration=cal, config=cfg, progress=False)
    with pytest.warns(UserWarning, match="never reached"):
        sim = Q(f, params, calibration=cal, config=cfg, mode="simulate", progress=False)
    act = get_state(qf.program, "test").act
    taken = [k for k in act if "branch" in k]
    assert taken == [f"cond/branch{branch}/dot_general"], list(act)
    rows = {r.name: r for r in qf.report().layers}
    other = rows[f"cond/branch{(branch + 1) % 3}/dot_general"]
    assert other.status == "quantized" and "dynamic" in other.activations
    x = rng.normal(size=(3, D)).astype(np.float32)
    for n, k in ((max(trips), branch), (0, (branch + 1) % 3)):
        got = jax.jit(qf.apply)(qf.params, x, np.int32(n), np.int32(k))
        want = sim(x, np.int32(n), np.int32(k))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


# ---- int8 KV cache ------------------------------------------------------------------------------

B, T = 2, 6


def decode(params, xs):
    """One attention head decoding a sequence step by step, keys and values cached."""

    def step(carry, x):
        kc, vc, t = carry
        q, k, v = x @ params["q"], x @ params["k"], x @ params["v"]
        kc = jax.lax.dynamic_update_slice(kc, k[:, None], (0, t, 0))
        vc = jax.lax.dynamic_update_slice(vc, v[:, None], (0, t, 0))
        s = jnp.einsum("bd,btd->bt", q, kc) / np.sqrt(D)
        s = jnp.where(jnp.arange(T)[None] <= t, s, -1e9)
        return (kc, vc, t + 1), jnp.einsum("bt,btd->bd", jax.nn.softmax(s), vc) @ params["o"]

    init = (jnp.zeros((B, T, D)), jnp.zeros((B, T, D)), jnp.int32(0))
    return jax.lax.scan(step, init, xs)[1]


def decode_case(seed, batches):
    """Params, calibration batches, an input, its float result and the default W8A8 function
    of :func:`decode`."""
    rng = np.random.default_rng(seed)
    params = {k: (rng.normal(size=(D, D)) / 3).astype(np.float32) for k in "qkvo"}
    cal = [(rng.normal(size=(T, B, D)).astype(np.float32),) for _ in range(batches)]
    xs = rng.normal(size=(T, B, D)).astype(np.float32)
    plain = Q(decode, params, calibration=cal, progress=False)
    return rng, params, cal, xs, np.asarray(decode(params, xs)), plain


def test_an_int8_kv_cache_is_carried_as_codes_and_scales():
    rng, params, cal, xs, ref, plain = decode_case(6, 8)
    cfg = QConfig(kv_cache=True)
    qf = Q(decode, params, calibration=cal, config=cfg, progress=False)
    sim = Q(decode, params, calibration=cal, config=cfg, mode="simulate", progress=False)
    (loop,) = [e for e in qf.specialize(xs).equations() if e.primitive == "scan"]
    carried = [(str(a.dtype), tuple(a.shape)) for a in loop.in_avals]
    assert carried.count(("int8", (B, T, D))) == 2  # keys and values: codes
    assert carried.count(("float32", (B, T, 1))) == 2  # one scale per position (and head)
    assert ("float32", (B, T, D)) not in carried
    y = np.asarray(jax.jit(qf.apply)(qf.params, xs))
    np.testing.assert_allclose(y, np.asarray(sim(xs)), rtol=1e-5, atol=1e-5)
    assert sqnr_db(ref, y) > sqnr_db(ref, np.asarray(plain(xs))) - 1.0
    # the report says so (it read the same with and without the option)
    for f in (qf, sim):
        assert f.report().kv_caches == (loop.name,) and loop.name in str(f.report())
    assert plain.report().kv_caches == () and "KV cache" not in str(plain.report())
    with pytest.raises(QuantizeError, match="found no KV cache.*dynamic_update_slice"):
        Q(
            functools.partial(scanned, False),
            make_params(rng, 2),
            calibration=batches(rng),
            config=cfg,
            progress=False,
        )


def test_an_integer_buffer_written_in_a_decode_loop_is_not_a_kv_cache():
    """Token ids kept per step (int32, written like a cache) went through an int8 scale: the
    ids came back wrong. Only float carries are caches."""
    rng, params, cal, xs, ref, plain = decode_case(7, 2)

    def with_ids(params, xs):
        def step(carry, x):
            kc, ids, t = carry
            kc = jax.lax.dynamic_update_slice(kc, (x @ params["k"])[:, None], (0, t, 0))
            top = jax.lax.top_k(jnp.einsum("bd,btd->bt", x @ params["q"], kc), 2)[1]
            ids = jax.lax.dynamic_update_slice(ids, (top * 1000 + 7)[:, None], (0, t, 0))
            return (kc, ids, t + 1), None

        init = (jnp.zeros((B, T, D)), jnp.zeros((B, T, 2), jnp.int32), jnp.int32(0))
        return jax.lax.scan(step, init, xs)[0][1]

    cfg = QConfig(kv_cache=True, activations=None)
    qf = Q(with_ids, params, calibration=cal, config=cfg, progress=False)
    (loop,) = [e for e in qf.specialize(xs).equations() if e.primitive == "scan"]
    carried = [(str(a.dtype), tuple(a.shape)) for a in loop.in_avals]
    assert ("int8", (B, T, D)) in carried and ("int32", (B, T, 2)) in carried
    assert np.all(np.asarray(qf(xs)) % 1000 == 7)  # (ids as written; an int8 scale broke them)


def stacked_decode(params, xs):
    """A decode loop over a layer stack: each layer's cache is a slice of one stacked cache,
    threaded through the layer scan as xs and back as ys (the MaxText / nn.scan layout)."""
    layers = params["q"].shape[0]

    def layer(carry, lp):
        x, t = carry
        p, kc, vc = lp
        q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
        kc = jax.lax.dynamic_update_slice(kc, k[:, None], (0, t, 0))
        vc = jax.lax.dynamic_update_slice(vc, v[:, None], (0, t, 0))
        s = jnp.where(jnp.arange(T)[None] <= t, jnp.einsum("bd,btd->bt", q, kc), -1e9)
        x = x + jnp.einsum("bt,btd->bd", jax.nn.softmax(s / np.sqrt(D)), vc) @ p["o"]
        return (x, t), (kc, vc)

    def step(carry, x):
        kc, vc, t = carry
        (x, _), (kc, vc) = jax.lax.scan(layer, (x, t), (params, kc, vc))
        return (kc, vc, t + 1), x

    cache = jnp.zeros((layers, B, T, D))
    return jax.lax.scan(step, (cache, cache, jnp.int32(0)), xs)[1]


def test_an_int8_kv_cache_threads_through_a_layer_stack():
    rng = np.random.default_rng(7)
    params = {k: (rng.normal(size=(3, D, D)) / 4).astype(np.float32) for k in "qkvo"}
    cal = [(rng.normal(size=(T, B, D)).astype(np.float32),) for _ in range(8)]
    xs = rng.normal(size=(T, B, D)).astype(np.float32)
    ref = np.asarray(stacked_decode(params, xs))
    plain = Q(stacked_decode, params, calibration=cal, progress=False)
    qf = Q(stacked_decode, params, calibration=cal, config=QConfig(kv_cache=True), progress=False)
    loops = [e for e in qf.specialize(xs).equations() if e.primitive == "scan"]
    for loop in loops:  # the step loop carries them, the layer loop slices them: int8 in both
        avals = [(str(a.dtype), tuple(a.shape)) for a in loop.in_avals]
        assert avals.count(("int8", (3, B, T, D))) == 2
        assert ("float32", (3, B, T, D)) not in avals
    y = np.asarray(jax.jit(qf.apply)(qf.params, xs))
    assert sqnr_db(ref, y) > sqnr_db(ref, np.asarray(plain(xs))) - 1.0


@pytest.mark.parametrize(
    "config", [QConfig(activations=None), QConfig(dynamic=True)], ids=["weight_only", "dynamic"]
)
def test_stacks_without_calibrated_activations(config):
    rng = np.random.default_rng(8)
    params = make_params(rng, 2)
    cal = batches(rng)
    qf = Q(
        functools.partial(scanned, False), params, calibration=cal, config=config, progress=False
    )
    w1 = qf.params["stack"]["w1"]
    assert w1.layers == 2 and w1.act_scale is None
    x = cal[0][0]
    assert sqnr_db(np.asarray(scanned(False, params, x)[0]), np.asarray(qf(x)[0])) > 25


@pytest.mark.parametrize("layers", [3, 4], ids=["packed_per_layer", "packed_across_layers"])
@pytest.mark.parametrize(
    "config",
    [
        QConfig(weights=Scheme(bits=4, granularity="channel")),
        QConfig(weights=Scheme(bits=4, granularity="group", group_size=4), activations=None),
    ],
    ids=["w4a8", "w4_group"],
)
def test_int4_stacks_are_unpacked_one_layer_per_iteration(layers, config):
    """Int4 codes of a stack stay packed through the loop: each iteration unpacks its own layer
    (from its slice of the bytes, or from its nibbles of the bytes it shares with layer
    ``i +- n/2`` when the packing axis is the stack's), with the results of each layer quantized
    alone."""
    rng = np.random.default_rng(11)
    params = make_params(rng, layers)
    cal = batches(rng, n=2, rows=8)
    x = cal[0][0]
    for reverse in (False, True):
        got = Q(
            functools.partial(scanned, reverse),
            params,
            calibration=cal,
            config=config,
            progress=False,
        )
        want = Q(
            functools.partial(unrolled, reverse),
            per_layer(params),
            calibration=cal,
            config=config,
            progress=False,
        )
        assert got.params["stack"]["w1"].codes.shape[0] == (layers // 2 if layers % 2 == 0 else 3)
        for a, b in zip(jax.tree.leaves(got(x)), jax.tree.leaves(want(x)), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

    # the loop's temporaries hold one layer unpacked, not the stack
    big = {"w1": rng.normal(size=(8, 256, 256)).astype(np.float32) / 16}
    step = lambda h, w: (jnp.tanh(h @ w), None)
    stack = lambda p, h: jax.lax.scan(step, h, p["w1"])[0]
    h = rng.normal(size=(2, 256)).astype(np.float32)
    qf = Q(stack, big, calibration=[(h,)], config=config, progress=False)
    compiled = jax.jit(qf.apply).lower(qf.params, h).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < big["w1"].size  # (int8 codes: 512 KiB)


# ---- int8 attention (activation x activation matmuls) -------------------------------------------


@pytest.mark.xla_cpu
def test_attention_matmuls_run_int8_with_run_time_scales():
    """``QConfig(attention=...)``: ``Q K^T`` and ``P V`` (no weight operand) run int8 x int8 ->
    int32 with one scale per row of each operand, inside the decode loop too."""
    _, params, cal, xs, ref, plain = decode_case(12, 4)
    cfg = QConfig(attention=Scheme(granularity="token"))
    qf = Q(decode, params, calibration=cal, config=cfg, progress=False)
    sim = Q(decode, params, calibration=cal, config=cfg, mode="simulate", progress=False)
    dots = [e for e in qf.specialize(xs).equations() if e.primitive == "dot_general"]
    assert [str(e.params["preferred_element_type"]) for e in dots] == ["int32"] * 6
    rows = {r.name: r for r in qf.report().layers}
    att = rows["scan/bd,btd->bt/dot_general"]
    assert att.status == "quantized" and "dynamic (both operands)" in att.activations
    y = np.asarray(jax.jit(qf.apply)(qf.params, xs))
    np.testing.assert_allclose(y, np.asarray(sim(xs)), rtol=1e-5, atol=1e-5)
    assert sqnr_db(ref, y) > sqnr_db(ref, np.asarray(plain(xs))) - 1.5


@pytest.mark.parametrize("granularity", ["token", "tensor"])
def test_an_int8_activation_product_is_the_integer_product_times_both_scales(granularity):
    """Batched ``bhsd,bhtd->bhst``: the scale is ``max|x| / 127`` over the contracted axis of
    each row (or over the operand); a row holding NaN gives NaN outputs in that row only."""
    rng = np.random.default_rng(13)
    a = rng.normal(size=(2, 3, 4, 8)).astype(np.float32)
    b = (rng.normal(size=(2, 3, 5, 8)) * 10).astype(np.float32)

    def f(a, b):
        return jnp.einsum("bhsd,bhtd->bhst", a, b)

    cfg = QConfig(attention=Scheme(granularity=granularity))
    qf = Q(f, calibration=[(a, b)], config=cfg, progress=False)
    axes = (3,) if granularity == "token" else (0, 1, 2, 3)
    sa = np.max(np.abs(a), axis=axes, keepdims=True) / 127
    sb = np.max(np.abs(b), axis=axes, keepdims=True) / 127
    qa, qb = np.round(a / sa), np.round(b / sb)
    acc = np.einsum("bhsd,bhtd->bhst", qa.astype(np.int64), qb.astype(np.int64))
    want = acc * (sa * np.swapaxes(sb, 2, 3) if granularity == "token" else sa * sb)
    np.testing.assert_allclose(np.asarray(qf(a, b)), want, rtol=1e-5)
    bad = a.copy()
    bad[1, 2, 3, 0] = np.nan
    y = np.asarray(qf(bad, b))
    # (per tensor too: the scale comes from the finite rows, and a NaN spoiled the whole batch)
    assert np.isnan(y[1, 2, 3]).all() and np.isfinite(np.delete(y.reshape(-1, 5), 23, 0)).all()
    if granularity == "tensor":
        sa = np.max(np.abs(np.where(np.isnan(bad), 0, bad))) / 127
        acc = np.einsum("bhsd,bhtd->bhst", np.round(bad / sa), qb)
        np.testing.assert_allclose(y[0], (acc * sa * sb)[0], rtol=1e-5)


def test_attention_scheme_validation():
    for bad in (Scheme(symmetric=False), Scheme(granularity="channel"), Scheme(bits=16)):
        with pytest.raises(ValueError, match="QConfig: attention must be"):
            QConfig(attention=bad)


def test_a_stacked_weight_read_outside_its_loop_simulates_its_layers_codes():
    """Simulate fake-quantized a stacked weight read as floats outside its scan with one scale
    per channel over all layers, where realize reads each layer's codes (relative error 0.51
    against realize's 0.004 on a layer 100x smaller than the first; a helper): QAT trained
    another function than the one deployed. Each layer now gets its own scales there too."""
    params = make_params(np.random.default_rng(14), 3, spread=0.1)

    def f(p, x):
        y = scanned(False, p, x)[0]
        return y, x @ p["stack"]["w1"][2]  # (the smallest layer's weight, read outside)

    x = np.random.default_rng(15).normal(size=(4, D)).astype(np.float32)
    with pytest.warns(UserWarning, match="through slice"):  # (the read outside stays float)
        qs = Q(f, params, calibration=[(x,)], mode="simulate", progress=False)
    got, want = qs.apply(params, x), qs.realize(params)(x)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
