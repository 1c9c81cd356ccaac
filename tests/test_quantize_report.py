"""The per-layer report (SQNR, worst first, JSON, PNG), saving quantized models, and sharding them."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxq
from jaxq.quantize import QuantizeError

rng = np.random.default_rng(0)
W0 = rng.standard_normal((16, 64)).astype(np.float32) * 0.3
W1 = rng.standard_normal((64, 64)).astype(np.float32) * 0.2
W2 = rng.standard_normal((64, 8)).astype(np.float32) * 0.3
B1 = rng.standard_normal(64).astype(np.float32) * 0.1
X = [rng.standard_normal((8, 16)).astype(np.float32) for _ in range(4)]


def mlp(x):
    with jax.named_scope("Dense_0"):
        x = jax.nn.relu(x @ W0)
    with jax.named_scope("Dense_1"):
        x = jax.nn.relu(x @ W1 + B1)
    with jax.named_scope("Dense_2"):
        return x @ W2


@pytest.fixture(scope="module")
def qf():
    return jaxq.quantize(mlp, calibration=[(x,) for x in X], progress=False)


def test_report_has_sqnr_worst_first_and_matches_a_direct_measurement(qf):
    plain = qf.report()
    assert all(r.sqnr_db is None for r in plain.layers)
    rep = qf.report(sample=(X[0],))
    sq = [r.sqnr_db for r in rep.layers]
    assert len(sq) == 3 and sq == sorted(sq)  # worst first
    assert all(15 < v < 60 for v in sq)  # int8: tens of dB, not exact, not broken
    # the first layer's SQNR is the error of its own fake-quantized output
    sim = jaxq.quantize(mlp, calibration=[(x,) for x in X], mode="simulate", progress=False)
    got = jaxq.intermediates(sim.specialize(X[0]), ["Dense_0/dot_general"], X[0])
    ref = X[0] @ W0
    want = 10 * math.log10(
        np.sum(ref.astype(np.float64) ** 2)
        / np.sum((ref - np.asarray(got["Dense_0/dot_general"])) ** 2)
    )
    row = next(r for r in rep.layers if r.name == "Dense_0/dot_general")
    assert row.sqnr_db == pytest.approx(want, abs=1e-3)
    assert "SQNR dB" in str(rep)
    # an empty sample measures nothing: NaN, not an infinite (perfect) SQNR
    empty = qf.report(sample=(X[0][:0],))
    assert all(math.isnan(r.sqnr_db) for r in empty.layers)


@pytest.mark.parametrize("method", ["mse", "gptq"])
def test_the_weight_column_names_how_codes_were_chosen_for_params_too(method):
    params = {"w0": W0, "w1": W1}
    f = lambda p, x: jax.nn.relu(x @ p["w0"]) @ p["w1"]
    cfg, cal = jaxq.QConfig(weight_calibration=method), [(x,) for x in X]
    qf = jaxq.quantize(f, params, calibration=cal, config=cfg, progress=False)
    assert all(r.weights.endswith(f" {method}") for r in qf.report().layers)
    if method == "gptq":  # (simulate rounds the params it is given; GPTQ's codes come at realize)
        with pytest.warns(UserWarning, match="GPTQ chooses codes"):
            qs = jaxq.quantize(f, params, calibration=cal, config=cfg, mode="simulate")
        assert all("gptq (at realize" in r.weights for r in qs.report().layers)


def test_layers_name_their_weights_param_path():
    """Equinox layers are named ``vmap(eqx.nn.MLP)/eqx.nn.Linear/dot_general_1``, which say
    little: with params as an argument each row also gives its weight's path, the table a
    ``param`` column (a closure-style function's report has neither)."""
    params = {"enc": {"w": W0}, "dec": [W1]}
    f = lambda p, x: jax.nn.relu(x @ p["enc"]["w"]) @ p["dec"][0]
    qf = jaxq.quantize(f, params, calibration=[(x,) for x in X], progress=False)
    assert [r.param for r in qf.report().layers] == ["['enc']['w']", "['dec'][0]"]
    head = str(qf.report()).splitlines()[1].split()
    assert head[:3] == ["layer", "param", "primitive"]
    assert "['dec'][0]" in str(qf.report())
    closed = jaxq.quantize(lambda x: f(params, x), calibration=[(x,) for x in X], progress=False)
    assert all(r.param is None for r in closed.report().layers)
    assert "param" not in str(closed.report()).splitlines()[1].split()
    # a layer a rule keeps float names its weight too (what the rule's pattern matched)
    skip = jaxq.QConfig(rules=(jaxq.Rule(pattern=r"\['dec'\]", skip=True),))
    qs = jaxq.quantize(f, params, calibration=[(x,) for x in X], config=skip, progress=False)
    rows = [(r.param, r.status) for r in qs.report().layers]
    assert rows == [("['enc']['w']", "quantized"), ("['dec'][0]", "skipped by rules[0]")]


def test_report_as_json_and_png(qf, tmp_path):
    rep = qf.report(sample=(X[0],))
    data = json.loads(rep.to_json(tmp_path / "report.json"))
    assert [r["name"] for r in data["layers"]] == [r.name for r in rep.layers]
    assert json.loads((tmp_path / "report.json").read_text()) == data
    pytest.importorskip("matplotlib")
    png = rep.save_plot(tmp_path / "sqnr.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no SQNR in this report"):
        qf.report().save_plot(tmp_path / "none.png")


def test_saved_quantized_model_is_small_exact_and_runs_alone(qf, tmp_path):
    pytest.importorskip("safetensors")
    f32 = jaxq.trace(mlp, X[0]).save(tmp_path / "float.jaxq")
    i8 = qf.save(tmp_path / "int8.jaxq")
    q4 = jaxq.quantize(
        mlp,
        calibration=[(x,) for x in X],
        progress=False,
        config=jaxq.QConfig(weights=jaxq.Scheme(bits=4, granularity="channel"), activations=None),
    )
    i4 = q4.save(tmp_path / "int4.jaxq")
    loaded = jaxq.load(i8)
    np.testing.assert_array_equal(loaded(X[1]), jax.jit(qf.program.as_fun())(X[1]))
    # (saved with a symbolic batch, the weight-only layers dequantize their weights; traced at a
    # few rows they scale the output instead: equal within float rounding)
    np.testing.assert_allclose(
        jaxq.load(i4)(X[1]), jax.jit(q4.program.as_fun())(X[1]), rtol=1e-5, atol=1e-6
    )
    # stored tensor bytes (the file adds a fixed header: the exported program); the on-disk goals
    # for real models are measured by benchmarks/bench_quantize.py
    stored = {p.name: jaxq.load(p).param_bytes for p in (f32, i8, i4)}
    assert stored["int8.jaxq"] <= 0.33 * stored["float.jaxq"]  # per-channel scales on 8..64 rows
    assert stored["int4.jaxq"] <= 0.6 * stored["int8.jaxq"]
    assert i8.stat().st_size < f32.stat().st_size


def test_jax_export_round_trip_of_a_quantized_function(qf):
    pytest.importorskip("flatbuffers")
    exported = jax.export.export(jax.jit(qf))(X[0])
    back = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(back.call(X[1]), jax.jit(qf)(X[1]))


def test_quantized_function_under_data_and_channel_sharding(qf):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    x = np.concatenate(X)
    data = NamedSharding(mesh, PartitionSpec("data"))
    want = jax.jit(qf)(x)
    got = jax.jit(qf)(jax.device_put(x, data))  # data-parallel inference
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    prog = qf.specialize(x)
    fun, consts = jaxq.split_constants(prog)
    shardings = jaxq.constant_shardings(prog, mesh, "model")
    int8 = [
        s.spec for c, s in zip(consts, shardings, strict=True) if np.asarray(c).dtype == np.int8
    ]
    assert int8 and all("model" in spec for spec in int8)  # int8 weights split by output channel
    placed = [jax.device_put(c, s) for c, s in zip(consts, shardings, strict=True)]
    got = jax.jit(fun)(placed, jax.device_put(x, data))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_calibration_on_sharded_batches_gives_the_same_scales():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    data = NamedSharding(mesh, PartitionSpec("data"))
    plain = jaxq.quantize(mlp, calibration=[(x,) for x in X], progress=False)
    sharded = jaxq.quantize(
        mlp, calibration=[(jax.device_put(x, data),) for x in X], progress=False
    )
    scales = lambda q: [
        (r.name, r.activation_scale, r.activation_zero_point) for r in q.report().layers
    ]
    assert scales(sharded) == scales(plain)
    assert all(s is not None for _, s, _ in scales(plain))


# -- padded positions: report(sample=..., mask=...) ------------------------------------------------

TOK = {
    "w0": rng.standard_normal((16, 32)).astype(np.float32) * 0.3,
    "w1": rng.standard_normal((32, 8)).astype(np.float32) * 0.3,
}
LENGTHS = np.array([5, 2, 7])  # valid tokens per sequence, of 7


def tokens(params, x):  # [batch, tokens, features]
    with jax.named_scope("Dense_0"):
        h = jax.nn.relu(x @ params["w0"])
    with jax.named_scope("Dense_1"):
        return h @ params["w1"]


def padded(seed, garbage):
    """A batch of 3 sequences of 7 tokens, ``garbage`` at the padded ones, and its mask."""
    r = np.random.default_rng(seed)
    valid = np.arange(7)[None, :] < LENGTHS[:, None]
    x = r.standard_normal((3, 7, 16)).astype(np.float32)
    x = np.where(valid[..., None], x, garbage * r.standard_normal(x.shape)).astype(np.float32)
    return x, valid


@pytest.fixture(scope="module")
def tok_qf():
    cal = [(padded(s, 0.0)[0],) for s in range(3)]  # calibrated with zeros at padding
    return jaxq.quantize(tokens, TOK, calibration=cal, progress=False)


def test_masked_report_counts_only_valid_positions(tok_qf):
    x, valid = padded(10, 300.0)  # padded positions hold garbage far outside the calibrated range
    plain = {r.name: r for r in tok_qf.report(sample=(x,)).layers}
    rep = tok_qf.report(sample=(x,), mask=valid)
    rows = {r.name: r for r in rep.layers}
    for name in ("Dense_0/dot_general", "Dense_1/dot_general"):
        assert rows[name].sqnr_db > plain[name].sqnr_db + 20, name  # the garbage dominated
        assert rows[name].sqnr_db > 25
    assert plain["Dense_0/dot_general"].clipped > 0.3
    assert rows["Dense_0/dot_general"].clipped < 0.02  # the padding was out of range
    # by hand: the fake-quantized output on the valid rows only
    sim = jaxq.quantize(
        tokens,
        TOK,
        calibration=[(padded(s, 0.0)[0],) for s in range(3)],
        mode="simulate",
        progress=False,
    )
    got = jaxq.intermediates(sim.specialize(x), ["Dense_0/dot_general"], TOK, x)
    ref = np.asarray(jnp.asarray(x) @ TOK["w0"], np.float64)[valid]
    approx = np.asarray(got["Dense_0/dot_general"], np.float64)[valid]
    want = 10 * math.log10(np.sum(ref**2) / np.sum((ref - approx) ** 2))
    assert rows["Dense_0/dot_general"].sqnr_db == pytest.approx(want, abs=1e-3)
    # an integer attention mask reads the same; all-valid is the unmasked report
    same = {
        r.name: r.sqnr_db for r in tok_qf.report(sample=(x,), mask=valid.astype(np.int32)).layers
    }
    assert same == {n: r.sqnr_db for n, r in rows.items()}
    full = tok_qf.report(sample=(x,), mask=np.ones((3, 7), bool))
    assert [(r.name, r.sqnr_db) for r in full.layers] == [
        (r.name, r.sqnr_db) for r in tok_qf.report(sample=(x,)).layers
    ]
    # a mask over the batch only (size-1 token axis) keeps whole sequences
    seq = tok_qf.report(sample=(x,), mask=np.array([[True], [False], [False]]))
    ref0 = np.asarray(jnp.asarray(x[:1]) @ TOK["w0"], np.float64)
    approx0 = np.asarray(got["Dense_0/dot_general"], np.float64)[:1]
    want0 = 10 * math.log10(np.sum(ref0**2) / np.sum((ref0 - approx0) ** 2))
    row0 = next(r for r in seq.layers if r.name == "Dense_0/dot_general")
    assert row0.sqnr_db == pytest.approx(want0, abs=1e-3)


def test_masked_report_on_flattened_tokens():
    def flat(params, x):  # [batch, tokens, features] -> [batch * tokens, features]
        with jax.named_scope("Dense_0"):
            return x.reshape(-1, x.shape[-1]) @ params["w0"]

    cal = [(padded(s, 0.0)[0],) for s in range(2)]
    qf = jaxq.quantize(flat, {"w0": TOK["w0"]}, calibration=cal, progress=False)
    x, valid = padded(11, 300.0)
    (row,) = qf.report(sample=(x,), mask=valid).layers
    (plain,) = qf.report(sample=(x,)).layers
    assert row.sqnr_db > plain.sqnr_db + 20 and row.clipped < 0.02 < plain.clipped


def test_a_pooled_layer_counts_the_examples_with_a_valid_position():
    """A BERT-style pooler (``[batch, features]``: no token axis) under a ``[batch, tokens]``
    mask: a row counts where its example has a valid token (it raised, so a stock Flax BERT
    could not be reported with a mask)."""

    def pooled(params, x):
        with jax.named_scope("Dense_0"):
            h = jax.nn.relu(x @ params["w0"])
        with jax.named_scope("Pooler"):
            return h[:, 0] @ params["w1"]  # (the first token's row, as BERT's pooler)

    cal = [(padded(s, 0.0)[0],) for s in range(2)]
    qf = jaxq.quantize(pooled, TOK, calibration=cal, progress=False)
    x, valid = padded(13, 300.0)
    rows = {r.name: r for r in qf.report(sample=(x,), mask=valid).layers}
    plain = {r.name: r for r in qf.report(sample=(x,)).layers}
    assert rows["Pooler/dot_general"].sqnr_db == plain["Pooler/dot_general"].sqnr_db  # all rows
    assert rows["Dense_0/dot_general"].sqnr_db > plain["Dense_0/dot_general"].sqnr_db + 20
    # an example with no valid token drops its pooled row
    first = valid & (np.arange(3) == 0)[:, None]
    one = {r.name: r for r in qf.report(sample=(x,), mask=first).layers}
    sub = {r.name: r for r in qf.report(sample=(x[:1],)).layers}
    assert one["Pooler/dot_general"].sqnr_db == pytest.approx(sub["Pooler/dot_general"].sqnr_db)


def test_a_layer_in_a_loop_over_time_reads_each_step_of_the_mask():
    """An RNN step's ``[batch, features]`` input under a ``[batch, time]`` mask: each step
    counts the rows valid at that step (the mask was reduced over time, so padded steps counted:
    25% clipped, 0.7 dB). Causal, so the padded sample reports as its valid prefix alone."""

    def rnn(params, x):  # x [batch, time, features]
        def step(h, xt):
            with jax.named_scope("cell"):
                h = jnp.tanh(xt @ params["wx"] + h)
            return h, h

        return lax.scan(step, jnp.zeros((x.shape[0], 64)), jnp.swapaxes(x, 0, 1))[1]

    cal = [(rng.standard_normal((4, 6, 16)).astype(np.float32),) for _ in range(2)]
    qf = jaxq.quantize(rnn, {"wx": W0}, calibration=cal, progress=False)
    x = rng.standard_normal((4, 6, 16)).astype(np.float32)
    x[:, 4:] = 50.0  # padding at the last two steps
    valid = np.arange(6)[None, :] < np.array([[4]] * 4)
    (row,) = qf.report(sample=(x,), mask=valid).layers
    (prefix,) = qf.report(sample=(x[:, :4],)).layers
    assert row.clipped == pytest.approx(prefix.clipped) and row.clipped < 0.01
    assert row.sqnr_db == pytest.approx(prefix.sqnr_db, rel=1e-4)


def test_a_mask_that_does_not_fit_names_the_layer_and_both_shapes(tok_qf):
    x, valid = padded(12, 1.0)
    with pytest.raises(QuantizeError) as info:
        tok_qf.report(sample=(x,), mask=np.ones((3, 6), bool))
    msg = str(info.value)
    assert "(3, 6)" in msg and "(3, 7, 32)" in msg and "'Dense_0/dot_general'" in msg
    assert "leading axes" in msg
    with pytest.raises(QuantizeError, match=r"\(7, 3\)"):
        tok_qf.report(sample=(x,), mask=valid.T)  # transposed: no axis matches
    with pytest.raises(TypeError, match="mask must be a bool array"):
        tok_qf.report(sample=(x,), mask=valid.astype(np.float32))
    with pytest.raises(ValueError, match="no valid position"):
        tok_qf.report(sample=(x,), mask=np.zeros((3, 7), bool))
    with pytest.raises(ValueError, match="applies to a sample"):
        tok_qf.report(mask=valid)


@pytest.mark.filterwarnings("ignore:jaxq.quantize.*inside scan:UserWarning")
def test_layers_inside_loops_are_marked_with_their_loop():
    def f(x):
        def body(h, _):
            with jax.named_scope("Step"):
                return jax.nn.relu(h @ W1), None

        h, _ = lax.scan(body, jax.nn.relu(x @ W0), None, length=2)
        with jax.named_scope("Branch"):
            h = lax.cond(h.sum() > 0, lambda v: v @ W1, lambda v: v @ (2 * W1), h)
        with jax.named_scope("Out"):
            return h @ W2

    qf = jaxq.quantize(f, calibration=[(x,) for x in X], progress=False)
    rep = qf.report(sample=(X[0],))
    rows = {r.name: r for r in rep.layers}
    assert rows["Out/dot_general"].in_loop is None and rows["Out/dot_general"].sqnr_db is not None
    assert rows["scan/Step/dot_general"].in_loop == "scan"
    assert rows["Branch/cond/branch0/dot_general"].in_loop == "cond"
    inside = [r for r in rows.values() if r.in_loop is not None]
    assert inside and all(r.sqnr_db is None for r in inside)
    assert all(r.status.startswith("inside a scan / while / cond body") for r in inside)
    assert json.loads(rep.to_json())["layers"][0]["in_loop"] is None


def test_a_quantized_layer_inside_a_loop_is_marked_too():
    def f(x):
        def body(c):
            i, h = c
            with jax.named_scope("Loop"):  # a weight made inside the body: known, quantized
                return i + 1, jnp.tanh(h @ jnp.full((16, 16), 0.1, jnp.float32))

        return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    cfg = jaxq.QConfig(dynamic=True)
    if jax.__version_info__ >= (0, 11):  # loop bodies take no constants of their own (hoisted):
        # the weight made inside is not folded into one (that raised RewriteError) and stays
        with pytest.warns(UserWarning, match=r"inside scan / while / cond bodies stay float"):
            qf = jaxq.quantize(f, calibration=[(X[0],)], config=cfg, progress=False)
        (row,) = qf.report().layers
        assert (row.status.startswith("inside a scan / while"), row.in_loop) == (True, "while")
        return
    qf = jaxq.quantize(f, calibration=[(X[0],)], config=cfg, progress=False)
    (row,) = qf.report(sample=(X[0],)).layers
    assert (row.status, row.in_loop, row.sqnr_db) == ("quantized", "while", None)
    assert "quantized (inside a while body)" in str(qf.report())


def test_an_attention_product_says_how_it_is_quantized_in_a_table_that_stays_narrow():
    """(Q K^T's status pointed at params, where the fix is QConfig(attention=...), and the
    table padded every row to that long status.)"""

    def f(x):
        with jax.named_scope("Q"):
            q = x @ W0
        with jax.named_scope("Att"):
            return jax.nn.softmax(q @ q.T) @ q

    qf = jaxq.quantize(f, calibration=[(x,) for x in X], progress=False)
    rows = {r.name: r.status for r in qf.report().layers}
    assert "QConfig(attention=jaxq.Scheme(granularity='token'))" in rows["Att/dot_general"]
    lines = str(qf.report()).splitlines()
    (quantized,) = [line for line in lines if line.startswith("Q/")]
    assert quantized.endswith("quantized") and len(quantized) < 150  # (was padded to 320)


@pytest.mark.parametrize("attention", [False, True])
def test_a_resize_says_its_interpolation_matrix_is_computed_and_stays_float(attention):
    """(jax.image.resize multiplies by matrices built from iota: the report said "both are
    activations" and pointed at QConfig(attention=...), under which they were rounded to int8.)"""
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(12, 6)).astype(np.float32)}
    f = lambda p, x: jax.image.resize(x, (x.shape[0], 12, 12), "bilinear") @ p["w"]
    xs = [(rng.normal(size=(2, 4, 8)).astype(np.float32),)]
    scheme = jaxq.Scheme(granularity="token") if attention else None
    qf = jaxq.quantize(f, params, calibration=xs, config=jaxq.QConfig(attention=scheme))
    rows = [r for r in qf.report().layers if r.status != "quantized"]
    assert len(rows) == 2 and all("computed in f from constants alone" in r.status for r in rows)
    assert not any("(both operands)" in str(r.activations) for r in qf.report().layers)


def test_int8_attention_products_have_an_sqnr_and_a_mask_passes_them_over():
    """Q K^T and P V under ``QConfig(attention=...)``: the report gave them no SQNR (layer_sqnr
    had it), and a ``[batch, tokens]`` mask, which their ``[batch, heads, t, s]`` outputs cannot
    take, raised for the whole report."""

    def f(p, x):  # [batch, tokens, features], one head axis
        q = (x @ p["w0"])[:, None]
        with jax.named_scope("Att"):
            s = jax.nn.softmax(jnp.einsum("bhtd,bhsd->bhts", q, q))
            return jnp.einsum("bhts,bhsd->bhtd", s, q)[:, 0] @ p["w1"]

    cal = [(padded(s, 0.0)[0],) for s in range(3)]
    cfg = jaxq.QConfig(attention=jaxq.Scheme(granularity="token"))
    qf = jaxq.quantize(f, TOK, calibration=cal, config=cfg, progress=False)
    x, valid = padded(10, 1.0)
    direct = qf.layer_sqnr(x)
    products = [n for n in direct if "->" in n]
    assert len(products) == 2
    rows = {r.name: r.sqnr_db for r in qf.report(sample=(x,)).layers}
    assert all(rows[n] == pytest.approx(direct[n]) for n in products)
    rows = {r.name: r.sqnr_db for r in qf.report(sample=(x,), mask=valid).layers}
    assert all(rows[n] is None for n in products) and rows["Att/dot_general"] > 20


def test_a_typed_prng_key_among_the_params_is_counted():
    """``jax.random.key`` in the params (an NNX model with Dropout keeps one in its state) made
    ``report()`` fail: numpy cannot convert a key array. Its 8 bytes count like any leaf's."""
    f = lambda p, x: x @ p["w"] + 0.01 * jax.random.normal(p["key"], (x.shape[0], 64))
    params = {"w": W0, "key": jax.random.key(0)}
    qf = jaxq.quantize(f, params, calibration=[(x,) for x in X], progress=False)
    report = qf.report(sample=(X[0],))
    # (jax.random's own constants are no parameters: a cache's zeros counted double a small
    # model's bytes, more than its float params)
    assert qf.specialize(X[0]).jaxpr.consts
    assert report.param_bytes == qf.params["w"].nbytes + 8
    assert report.layers[0].status == "quantized"
