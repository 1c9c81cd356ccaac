"""The per-layer report (SQNR, worst first, JSON, PNG), saving quantized models, and sharding them."""

import json
import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxq

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
    np.testing.assert_array_equal(jaxq.load(i4)(X[1]), jax.jit(q4.program.as_fun())(X[1]))
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
