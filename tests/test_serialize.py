"""Program.save / jaxq.load: one safetensors file, no pickle, exact round trip, clear errors."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxq

st = pytest.importorskip("safetensors.numpy")

W8 = np.arange(-24, 24, dtype=np.int8).reshape(6, 8)
SCALE = np.linspace(0.01, 0.02, 8, dtype=np.float32)
BIAS = np.linspace(-1, 1, 8).astype(jnp.bfloat16)


def model(inputs, *, shift):
    x = inputs["x"]
    acc = jax.lax.dot_general(
        x.astype(jnp.int8), W8, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32
    )
    return {"y": acc * SCALE + jnp.asarray(BIAS).astype(jnp.float32) + shift, "n": jnp.sum(x)}


X = {"x": np.arange(12, dtype=np.float32).reshape(2, 6) - 5}
PROG = jaxq.trace(model, X, shift=np.float32(0.5))


def test_round_trip_is_exact_and_keeps_storage_dtypes(tmp_path):
    path = PROG.save(tmp_path / "m.jaxq")
    loaded = jaxq.load(path)
    # compiled both sides: eager op-by-op evaluation rounds a fused multiply-add differently
    want = jax.jit(PROG.as_fun())(X, shift=np.float32(0.5))
    got = loaded(X, shift=np.float32(0.5))
    np.testing.assert_array_equal(got["y"], want["y"])
    np.testing.assert_array_equal(got["n"], want["n"])
    got_jit = jax.jit(lambda x: loaded(x, shift=np.float32(0.5)))(X)
    np.testing.assert_array_equal(got_jit["y"], want["y"])
    dtypes = sorted(str(np.asarray(c).dtype) for c in loaded.consts)
    assert "int8" in dtypes and "bfloat16" in dtypes
    stored = st.load_file(str(path))
    assert any(a.dtype == np.int8 for a in stored.values())  # int8 stays int8 on disk
    assert loaded.param_bytes == sum(np.asarray(c).nbytes for c in PROG.jaxpr.consts)
    assert "LoadedProgram" in repr(loaded)


# (its reference is computed where the file is loaded, on the CPU: XLA:GPU's int8 dot summed this
# 2x6 @ 6x8 product twice over on an H100, jax 0.11.2)
@pytest.mark.xla_cpu
def test_loaded_model_runs_without_the_model_code(tmp_path):
    path = PROG.save(tmp_path / "m.jaxq")
    np.save(tmp_path / "x.npy", X["x"])
    code = (
        "import sys, numpy as np, jaxq\n"
        f"m = jaxq.load({str(path)!r})\n"
        f"out = m({{'x': np.load({str(tmp_path / 'x.npy')!r})}}, shift=np.float32(0.5))\n"
        "np.save(sys.argv[1], np.asarray(out['y']))\n"
    )
    out_file = tmp_path / "y.npy"
    subprocess.run(
        [sys.executable, "-c", code, str(out_file)],
        check=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    want = jax.jit(PROG.as_fun())(X, shift=np.float32(0.5))["y"]
    np.testing.assert_array_equal(np.load(out_file), want)


def test_a_loaded_program_takes_its_weights_as_an_argument_under_jit(tmp_path):
    """jax.jit(loaded) compiles the weights in as constants (a 1B-parameter model: 30 s, 2 GB
    more memory); jax.jit(loaded.apply)(loaded.params, x) passes them, as qf.apply does."""
    w = np.linspace(-1, 1, 64 * 256, dtype=np.float32).reshape(64, 256)
    x = np.linspace(-1, 1, 3 * 64, dtype=np.float32).reshape(3, 64)
    qf = jaxq.quantize(lambda p, x: x @ p, w, calibration=[(x,)], progress=False)
    qf.save(tmp_path / "w.jaxq")
    loaded = jaxq.load(tmp_path / "w.jaxq")
    assert [np.asarray(v).dtype for v in loaded.params.values()].count(np.int8) == 1
    run = jax.jit(loaded.apply)
    np.testing.assert_array_equal(run(loaded.params, x), loaded(x))
    hlo = run.lower(loaded.params, x).as_text()
    assert len(hlo) < w.size  # (the int8 codes' 16384 bytes would be printed in it)
    with pytest.raises(TypeError, match=r"apply takes the loaded program's params"):
        loaded.apply(x)


def test_a_file_saved_on_a_gpu_runs_on_a_cpu(tmp_path, monkeypatch):
    # (a GPU machine quantizes, a CPU one serves: the file holds both lowerings)
    monkeypatch.setattr(jax.export, "default_export_platform", lambda: "cuda")
    loaded = jaxq.load(PROG.save(tmp_path / "m.jaxq"))
    assert loaded.exported.platforms == ("cuda", "cpu")
    want = jax.jit(PROG.as_fun())(X, shift=np.float32(0.5))["y"]
    np.testing.assert_array_equal(loaded(X, shift=np.float32(0.5))["y"], want)


def test_params_holding_a_typed_prng_key_save_and_load(tmp_path):
    """A Flax NNX model's state holds its Rngs' typed keys: save failed in np.asarray."""
    x = np.linspace(-1, 1, 48, dtype=np.float32).reshape(3, 16)
    params = {"w": np.full((16, 4), 0.1, np.float32), "key": jax.random.key(3)}

    def f(p, x):
        return x @ p["w"] + jax.random.normal(p["key"], (4,))

    qf = jaxq.quantize(f, params, calibration=[(x,)], progress=False)
    qf.save(tmp_path / "key.jaxq")
    np.testing.assert_array_equal(jaxq.load(tmp_path / "key.jaxq")(x), qf(x))


def test_overwrite_is_atomic_and_leaves_no_temporaries(tmp_path):
    path = tmp_path / "m.jaxq"
    PROG.save(path)
    other = jaxq.trace(lambda x: x * 2, np.ones(3, np.float32))
    other.save(path)
    assert os.listdir(tmp_path) == ["m.jaxq"]
    np.testing.assert_array_equal(jaxq.load(path)(np.ones(3, np.float32)), np.full(3, 2.0))


def _rewrite(path, tensors=None, **meta_updates):
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as fh:
        meta = dict(fh.metadata())
    tensors = st.load_file(str(path)) if tensors is None else tensors
    meta.update(meta_updates)
    st.save_file(tensors, str(path), metadata=meta)


def test_corrupted_weights_are_detected(tmp_path):
    path = PROG.save(tmp_path / "m.jaxq")
    tensors = st.load_file(str(path))
    key = next(k for k, v in tensors.items() if v.dtype == np.int8)
    tensors[key] = tensors[key].copy()
    tensors[key].flat[0] += 1  # one flipped weight would silently change results
    _rewrite(path, tensors)
    with pytest.raises(jaxq.LoadError, match="corrupted: its checksum does not match"):
        jaxq.load(path)


def test_truncated_file_and_foreign_files_are_clear_errors(tmp_path):
    path = PROG.save(tmp_path / "m.jaxq")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(jaxq.LoadError, match="truncated or corrupted"):
        jaxq.load(path)
    plain = tmp_path / "plain.safetensors"
    st.save_file({"w": np.ones(3, np.float32)}, str(plain))
    with pytest.raises(jaxq.LoadError, match="not a saved jaxq program"):
        jaxq.load(plain)
    with pytest.raises(FileNotFoundError):
        jaxq.load(tmp_path / "missing.jaxq")


def test_other_format_version_is_refused(tmp_path):
    path = PROG.save(tmp_path / "m.jaxq")
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as fh:
        manifest = json.loads(fh.metadata()["jaxq.manifest"])
    manifest.update(format_version=99, jaxq_version="9.9.9")
    _rewrite(path, **{"jaxq.manifest": json.dumps(manifest)})
    with pytest.raises(jaxq.LoadError, match=r"version 99 \(written by jaxq 9.9.9\).*Re-save"):
        jaxq.load(path)


def test_a_program_this_jax_cannot_read_is_refused_when_loaded(tmp_path, monkeypatch):
    """(A file that jax 0.12 wrote loaded on jax 0.10.2, then failed at its first call with a
    raw "Failed to deserialize StableHLO".) Reading the module fails as an older jax fails."""
    path = PROG.save(tmp_path / "m.jaxq")

    def unreadable(self):
        raise RuntimeError("INVALID_ARGUMENT: Failed to deserialize StableHLO\nmore")

    monkeypatch.setattr(jax.export.Exported, "mlir_module", unreadable)
    with pytest.raises(
        jaxq.LoadError,
        match=rf"cannot read the program .* which jax {jax.__version__} wrote \(INVALID_ARGUMENT: "
        r"Failed to deserialize StableHLO\)\. Load it with jax .* or re-save",
    ):
        jaxq.load(path)


def test_partitioned_program_exports_and_saves(tmp_path):
    from jaxq import partition as P
    from jaxq import transform as T

    P.register_op_support("ser_test", "dot_general")
    P.register_op_support("ser_test", "tanh")
    try:
        w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
        f = lambda x: jnp.tanh(x @ w) * 2
        x = np.ones((2, 3), np.float32)
        pipeline = T.Sequential(
            [P.annotate_target(["ser_test"]), P.merge_compiler_regions(), P.partition_graph()]
        )
        parts = pipeline(jaxq.trace(f, x))
        assert [r.compiler for r in P.regions(parts)] == ["ser_test"]
        want = jax.jit(parts.as_fun())(x)
        exported = jax.export.export(jax.jit(parts.as_fun()))(x)
        back = jax.export.deserialize(exported.serialize())
        np.testing.assert_array_equal(back.call(x), want)
        np.testing.assert_array_equal(jaxq.load(parts.save(tmp_path / "p.jaxq"))(x), want)
    finally:
        P.unregister_compiler("ser_test")


def test_a_loaded_program_names_an_argument_of_another_dtype(tmp_path):
    x = np.ones((3, 4), np.float32)
    loaded = jaxq.load(jaxq.trace(lambda x: jnp.sin(x) * 2, x).save(tmp_path / "f.jaxq"))
    assert loaded(x.astype(np.float64)).dtype == np.float32  # (canonicalized, as under jit)
    with pytest.raises(TypeError, match=r"args\[0\]: saved for float32\[3,4\], got int32\[3,4\]"):
        loaded(x.astype(np.int32))


def test_a_program_with_a_host_callback_cannot_be_saved_and_says_why(tmp_path):
    x = np.ones(3, np.float32)
    prog = jaxq.trace(
        lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct((3,), x.dtype), x), x
    )
    with pytest.raises(TypeError, match=r"calls back into Python .*save a program without them"):
        prog.save(tmp_path / "cb.jaxq")
