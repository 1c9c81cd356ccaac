"""Embedding tables: a ``gather`` of whole rows from a weight table, quantized per row (opt-in by
``Rule(primitives={"gather"})``) and dequantized after the gather, only the rows gathered."""

from __future__ import annotations

import functools
import itertools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from strategies import examples

import jaxq
from jaxq.quantize import QArray, QConfig, QuantizeError, Rule, Scheme

RNG = np.random.default_rng(0)
V, D, T = 24, 16, 6  # vocabulary, width, tokens
PARAMS = {
    "tok": (RNG.normal(size=(V, D)) * np.linspace(0.1, 3.0, V)[:, None]).astype(np.float32),
    "pos": (RNG.normal(size=(T, D)) * 0.5).astype(np.float32),
    "w": (RNG.normal(size=(D, 8)) * 0.3).astype(np.float32),
}
IDS = [RNG.integers(0, V, size=(3, T)).astype(np.int32) for _ in range(3)]
EMBED = QConfig(rules=(Rule(primitives={"gather"}),))  # int8 per row (the weights' scheme)


def lm(params, ids):
    """Token and position embeddings (two gathers), then a dense layer; returns the output, the
    token embeddings and the position embeddings."""
    with jax.named_scope("Embed"):
        e = params["tok"][ids]
        pos = jnp.take(params["pos"], jnp.arange(ids.shape[-1]), axis=0)
    with jax.named_scope("Dense"):
        return (e + pos) @ params["w"], e, pos


def tok(params, ids):
    with jax.named_scope("Embed"):
        return params["tok"][ids]


def as_jnp(tree):
    return jax.tree.map(jnp.asarray, tree)


def both(f, params, config, **kw):
    """Realized and simulated, calibrated on the same data."""
    cal = [(i,) for i in IDS]
    r = jaxq.quantize(f, params, calibration=cal, config=config, progress=False, **kw)
    s = jaxq.quantize(f, params, calibration=cal, config=config, mode="simulate", progress=False)
    return r, s


@functools.cache
def realized_lm():
    return both(lm, PARAMS, EMBED)


def row_scales(qa: QArray) -> np.ndarray:
    """One scale per row of a per-row QArray."""
    return np.asarray(qa.scale).reshape(-1)


# -- params style ---------------------------------------------------------------------------------


def test_tables_become_per_row_qarrays_and_realize_equals_simulate():
    r, s = realized_lm()
    for name, rows in (("tok", V), ("pos", T)):
        qa = r.params[name]
        assert isinstance(qa, QArray) and qa.bits == 8 and qa.codes.dtype == np.int8
        assert np.shape(qa.scale) == (rows, 1)  # one scale per row
    for ids in IDS:
        y_r, *rows_r = jax.jit(r.apply)(r.params, ids)
        y_s, *rows_s = s.apply(PARAMS, ids)
        for a, b in zip(rows_r, rows_s, strict=True):  # the gathered rows, bit for bit
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(y_r), np.asarray(y_s), rtol=1e-5, atol=1e-5)
    rows = {row.name: row for row in r.report(sample=(IDS[0],)).layers}
    for name in ("Embed/gather", "Embed/jit/gather"):  # (jnp.take runs inside a jit)
        row = rows[name]
        assert (row.primitive, row.status) == ("gather", "quantized"), row
        assert row.weights == "int8 sym channel narrow" and row.activations is None
        assert row.sqnr_db is not None and row.sqnr_db > 35
    assert rows["Dense/dot_general"].status == "quantized"
    assert "Embed/gather" in str(r.report())


def test_gathered_rows_are_within_half_a_row_scale_of_float():
    cfg = QConfig(activations=None, rules=(Rule(primitives={"gather"}),))
    qf = jaxq.quantize(tok, PARAMS, config=cfg, example_args=(IDS[0],), progress=False)
    scales = row_scales(qf.params["tok"])
    ids = np.arange(V, dtype=np.int32)[None]  # every row
    err = np.abs(np.asarray(qf(ids)) - PARAMS["tok"][ids])
    bound = scales[ids][..., None] / 2
    assert np.all(err <= bound * (1 + 1e-6)), float(np.max(err / bound))
    assert np.all(err.max(axis=-1) > 0)  # rows are really quantized
    assert np.ptp(scales) > 10 * scales.min()  # rows of different ranges keep their own scale


def test_parameter_bytes_drop():
    float_only = jaxq.quantize(lm, PARAMS, calibration=[(i,) for i in IDS], progress=False)
    r, _ = realized_lm()
    tables = 4 * (V + T) * D
    saved = float_only.report().param_bytes - r.report().param_bytes
    assert saved == tables - (V + T) * (D + 4)  # int8 codes and a float32 scale per row
    cfg4 = QConfig(rules=(Rule(primitives={"gather"}, weights=Scheme(bits=4)),))
    q4 = jaxq.quantize(lm, PARAMS, calibration=[(i,) for i in IDS], config=cfg4, progress=False)
    assert np.shape(q4.params["tok"].codes) == (V // 2, D)  # two codes a byte
    assert r.report().param_bytes - q4.report().param_bytes == (V + T) * D // 2


def test_new_params_and_qat_reach_the_tables():
    r, s = realized_lm()
    new = {**PARAMS, "tok": PARAMS["tok"] * 2}
    q = r.quantize_params(new)
    np.testing.assert_allclose(
        np.asarray(q["tok"].dequantize()), new["tok"], atol=float(row_scales(q["tok"]).max())
    )

    def loss(p):
        return jnp.sum(s.apply(p, IDS[0])[0] ** 2)

    g = jax.grad(loss)(as_jnp(PARAMS))
    used = np.zeros(V, bool)
    used[IDS[0].reshape(-1)] = True
    norms = np.abs(np.asarray(g["tok"])).sum(axis=1)
    assert np.all(norms[used] > 0) and np.all(norms[~used] == 0)  # straight through, by row


def test_saved_model_keeps_the_int8_table(tmp_path):
    pytest.importorskip("safetensors")
    r, _ = realized_lm()
    loaded = jaxq.load(r.save(tmp_path / "lm.jaxq"))
    for got, want in zip(loaded(IDS[1]), jax.jit(r)(IDS[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# -- out-of-range and negative indices --------------------------------------------------------------

LOOKUPS = {
    "index": lambda e, i: e[i],  # negative wraps, out of range clamps (promise_in_bounds)
    "take": lambda e, i: jnp.take(e, i, axis=0),  # out of range fills NaN
    "take_fill": lambda e, i: jnp.take(e, i, axis=0, fill_value=-7.0),
    "take_clip": lambda e, i: jnp.take(e, i, axis=0, mode="clip"),
    "take_axis1": lambda e, i: jnp.take(e.T, i, axis=1),  # a transposed table
    # per token under vmap (Equinox's Embedding): a gather with a start for every table axis
    "vmap_index": lambda e, i: jax.vmap(lambda j: e[j])(i.ravel()).reshape(*i.shape, -1),
}


def embed_with(lookup):
    def f(params, ids):
        with jax.named_scope("Embed"):
            return lookup(params["tok"], ids)

    return f


@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_out_of_range_and_negative_indices_behave_as_in_float(name):
    f = embed_with(LOOKUPS[name])
    ids = np.array([[0, -1, -V, V - 1, V, V + 5, -V - 1, -V - 7, 3]], np.int32)
    cfg = QConfig(activations=None, rules=(Rule(primitives={"gather"}),))
    r = jaxq.quantize(f, PARAMS, config=cfg, example_args=(ids,), progress=False)
    s = jaxq.quantize(f, PARAMS, config=cfg, example_args=(ids,), mode="simulate", progress=False)
    got, ref = np.asarray(jax.jit(r)(ids)), np.asarray(f(as_jnp(PARAMS), jnp.asarray(ids)))
    np.testing.assert_array_equal(got, np.asarray(s(ids)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))  # the same positions fill
    tol = float(row_scales(r.params["tok"]).max()) / 2 * (1 + 1e-6)
    np.testing.assert_allclose(got, ref, atol=tol, rtol=0)  # the same rows (or fill values)
    assert name not in ("take", "take_fill") or np.any(np.isnan(ref) | (ref == -7.0))


# -- closure style and int4 ----------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
def test_closed_over_tables(bits):
    table = jnp.asarray(PARAMS["tok"])

    def f(ids):
        with jax.named_scope("Embed"):
            return table[ids] * 2.0

    cfg = QConfig(activations=None, rules=(Rule(primitives={"gather"}, weights=Scheme(bits=bits)),))
    r = jaxq.quantize(f, config=cfg, example_args=(IDS[0],), progress=False)
    s = jaxq.quantize(f, config=cfg, example_args=(IDS[0],), mode="simulate", progress=False)
    ((row),) = r.report().layers
    assert row.status == "quantized" and row.weights.startswith(f"int{bits} ")
    np.testing.assert_array_equal(np.asarray(jax.jit(r)(IDS[1])), np.asarray(s(IDS[1])))
    stored = r.report().param_bytes
    assert stored == V * D * bits // 8 + 4 * V  # codes (packed for int4) and row scales
    assert stored < jaxq.trace(f, IDS[0]).jaxpr.consts[0].nbytes / 3


def test_int4_tables_of_every_packing():
    """Packed along the rows (an even vocabulary), along the width, or flat (both odd)."""
    for shape, name in itertools.product(((10, 6), (9, 6), (9, 5)), ("take", "vmap_index")):
        table = RNG.normal(size=shape).astype(np.float32)
        ids = np.array([[0, 4, 5, -1, shape[0], -shape[0] - 1, shape[0] - 1]], np.int32)
        cfg = QConfig(
            activations=None, rules=(Rule(primitives={"gather"}, weights=Scheme(bits=4)),)
        )
        f = embed_with(LOOKUPS[name])
        p = {"tok": table}
        r = jaxq.quantize(f, p, config=cfg, example_args=(ids,), progress=False)
        assert r.report().layers[0].status == "quantized"
        s = jaxq.quantize(f, p, config=cfg, example_args=(ids,), mode="simulate", progress=False)
        np.testing.assert_array_equal(np.asarray(jax.jit(r)(ids)), np.asarray(s(ids)))
        ref = np.asarray(f(as_jnp(p), jnp.asarray(ids)))
        tol = float(row_scales(r.params["tok"]).max()) / 2 * (1 + 1e-6)
        np.testing.assert_allclose(np.asarray(r(ids)), ref, atol=tol, rtol=0)


# -- what is not an embedding ---------------------------------------------------------------------


def test_gathers_stay_float_without_a_rule_and_say_why_with_one():
    plain = jaxq.quantize(lm, PARAMS, calibration=[(i,) for i in IDS], progress=False)
    assert not isinstance(plain.params["tok"], QArray)  # opt-in: no rule, no quantized table
    # listed all the same (often the largest weight; the report left it unsaid)
    lookups = sorted(r.status for r in plain.report().layers if r.primitive == "gather")
    assert [s.split(":")[0] for s in lookups] == [
        "a lookup in params['pos']",
        "a lookup in params['tok']",
    ]
    assert all("stays float (embeddings are opt-in" in s for s in lookups)

    def f(params, ids, h):
        with jax.named_scope("Slice"):
            a = params["tok"][ids, :4]  # partial rows
        with jax.named_scope("Act"):
            b = h[ids]  # a gather from an activation, not a table
        return a, b

    h = RNG.normal(size=(V, D)).astype(np.float32)
    cfg = QConfig(activations=None, rules=(Rule(primitives={"gather"}),))
    qf = jaxq.quantize(f, PARAMS, config=cfg, example_args=(IDS[0], h), progress=False)
    rows = {r.name: r.status for r in qf.report().layers}
    assert "partial slices" in rows["Slice/gather"] or "one table axis" in rows["Slice/gather"]
    assert rows["Act/gather"].startswith("a gather from an activation, not a table in params")
    assert not isinstance(qf.params["tok"], QArray)


def test_group_granularity_is_refused_for_a_table():
    cfg = QConfig(
        activations=None,
        rules=(Rule(primitives={"gather"}, weights=Scheme(granularity="group", group_size=4)),),
    )
    with pytest.raises(QuantizeError, match=r"granularity='group' does not apply to an embedding"):
        jaxq.quantize(tok, PARAMS, config=cfg, example_args=(IDS[0],), progress=False)


# -- a property over random tables and indices -----------------------------------------------------


@st.composite
def lookups(draw):
    v = draw(st.integers(1, 12))
    d = draw(st.integers(1, 7))
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    ids = draw(
        st.lists(
            st.integers(-v - 3, v + 3), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))
        )
    )
    seed = draw(st.integers(0, 2**16))
    table = np.random.default_rng(seed).normal(size=(v, d)).astype(np.float32)
    table *= np.random.default_rng(seed + 1).uniform(0.01, 10.0, size=(v, 1)).astype(np.float32)
    return (
        table,
        np.asarray(ids, np.int32).reshape(shape),
        draw(st.sampled_from(sorted(LOOKUPS))),
        draw(st.sampled_from([8, 4])),
    )


@settings(max_examples=examples(10), deadline=None)
@given(lookups())
@example(  # (the bound read row 3 for a clamped -3: the row a wrapping index finds)
    (
        np.array(
            [[0.9066419, 2.1555195], [1, -3.9], [7.4, 3.6], [-0.5, 0.54], [2, 1], [0, 4]], "f4"
        ),
        np.array([-3], np.int32),
        "take_clip",
        8,
    )
)
def test_random_tables_and_indices(case):
    table, ids, name, bits = case
    f = embed_with(LOOKUPS[name])
    p = {"tok": table}
    cfg = QConfig(activations=None, rules=(Rule(primitives={"gather"}, weights=Scheme(bits=bits)),))
    r = jaxq.quantize(f, p, config=cfg, example_args=(ids,), progress=False)
    s = jaxq.quantize(f, p, config=cfg, example_args=(ids,), mode="simulate", progress=False)
    got = np.asarray(jax.jit(r)(ids))
    np.testing.assert_array_equal(got, np.asarray(s(ids)))
    ref = np.asarray(f(as_jnp(p), jnp.asarray(ids)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    # every value within half its row's scale: the row is found where the float gather found it
    scales = row_scales(r.params["tok"])
    wraps = name != "take_clip"  # (mode="clip" clamps a negative index to row 0)
    rows = np.clip(np.where((ids < 0) & wraps, ids + table.shape[0], ids), 0, table.shape[0] - 1)
    bound = scales[rows] / 2 * (1 + 1e-6)
    bound = bound[None] if name == "take_axis1" else bound[..., None]
    ok = np.isnan(ref) | (np.abs(got - ref) <= bound)
    assert np.all(ok), (name, bits, got, ref)


# -- a tied output projection ---------------------------------------------------------------------


def tied(params, ids):
    """The token table embeds the ids and, transposed, projects back onto the vocabulary. (Dense's
    weight ``w @ w.T`` is computed from params: it stays float, and quantize warns so.)"""
    with jax.named_scope("Embed"):
        h = params["tok"][ids]
    with jax.named_scope("Dense"):
        h = jnp.tanh(h @ (params["w"] @ params["w"].T))
    with jax.named_scope("Head"):
        return h @ params["tok"].T, h


@pytest.mark.filterwarnings(r"ignore:.*\(params\['w'\] through dot_general\):UserWarning")
@pytest.mark.parametrize(
    "acts", [Scheme(symmetric=False), Scheme(), None], ids=["asym", "sym", "weight_only"]
)
def test_a_tied_output_projection_shares_the_table_codes(acts):
    cfg = QConfig(activations=acts, rules=(Rule(primitives={"gather"}),))
    r, s = both(tied, PARAMS, cfg)
    rows = {row.name: row for row in r.report(sample=(IDS[0],)).layers}
    assert rows["Head/dot_general"].status == "quantized"
    assert rows["Head/dot_general"].weight_scale == rows["Embed/gather"].weight_scale
    qa = r.params["tok"]  # one QArray: the codes both layers read
    assert isinstance(qa, QArray) and np.shape(qa.scale) == (V, 1)
    assert (qa.sums is not None) == (acts is not None and not acts.symmetric)  # (zero point)
    for ids in IDS:
        (y_r, _), (y_s, _) = jax.jit(r.apply)(r.params, ids), s.apply(PARAMS, ids)
        np.testing.assert_allclose(np.asarray(y_r), np.asarray(y_s), rtol=1e-4, atol=1e-4)
    assert rows["Head/dot_general"].sqnr_db > 25


@pytest.mark.filterwarnings(r"ignore:.*\(params\['w'\] through dot_general\):UserWarning")
def test_a_tied_projection_with_another_scheme_stays_float_and_says_why():
    cfg = QConfig(rules=(Rule(primitives={"gather"}, weights=Scheme(bits=4)),))
    with pytest.warns(UserWarning, match=r"Head/dot_general: .*\(quantized for 'Embed/gather'\)"):
        r, _ = both(tied, PARAMS, cfg)  # (it computes with the int4 table: said in the status only)
    rows = {row.name: row for row in r.report().layers}
    assert rows["Embed/gather"].weights.startswith("int4")
    assert "quantized for 'Embed/gather' with another scheme" in rows["Head/dot_general"].status


@pytest.mark.filterwarnings(r"ignore:.*\(params\['w'\] through dot_general\):UserWarning")
def test_a_tied_tables_lookup_without_the_rule_says_it_reads_the_heads_codes():
    """The lookup's row said "stays float (embeddings are opt-in)" while it reads the table the
    head quantizes, dequantized: the only values quantized params hold."""
    r = jaxq.quantize(tied, PARAMS, calibration=[(i,) for i in IDS], progress=False)
    (lookup,) = [row for row in r.report().layers if row.primitive == "gather"]
    assert lookup.status.startswith(
        "a lookup in params['tok'] (quantized for 'Head/dot_general'), a tied table: reads its "
        "dequantized codes"
    )
    h = np.asarray(r.apply(r.params, IDS[0])[1])
    (tok,) = [
        x
        for x in jax.tree.leaves(r.params, is_leaf=lambda x: isinstance(x, QArray))
        if isinstance(x, QArray)
    ]
    ref = jnp.tanh(tok.dequantize()[IDS[0]] @ (PARAMS["w"] @ PARAMS["w"].T))
    np.testing.assert_allclose(h, np.asarray(ref), rtol=1e-5, atol=1e-6)
