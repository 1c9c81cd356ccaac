"""The BERT loader of examples/bert.py, on a tiny checkpoint written here (the real MiniLM is an
optional extra exercised by examples/minilm.py)."""

import importlib.util
import json
import pathlib

import jax
import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

_spec = importlib.util.spec_from_file_location(
    "bert_example", pathlib.Path(__file__).parents[1] / "examples" / "bert.py"
)
bert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bert)

H, HEADS, INTER, LAYERS, VOCAB = 8, 2, 16, 2, 30


def _checkpoint(tmp_path, prefix=""):
    rng = np.random.default_rng(0)
    t = {}

    def lin(name, out, inp):
        t[f"{prefix}{name}.weight"] = rng.standard_normal((out, inp)).astype(np.float32) * 0.2
        t[f"{prefix}{name}.bias"] = rng.standard_normal(out).astype(np.float32) * 0.1

    def norm(name):
        t[f"{prefix}{name}.weight"] = 1 + 0.1 * rng.standard_normal(H).astype(np.float32)
        t[f"{prefix}{name}.bias"] = 0.1 * rng.standard_normal(H).astype(np.float32)

    t[f"{prefix}embeddings.word_embeddings.weight"] = rng.standard_normal((VOCAB, H)).astype(
        np.float32
    )
    t[f"{prefix}embeddings.position_embeddings.weight"] = rng.standard_normal((16, H)).astype(
        np.float32
    )
    t[f"{prefix}embeddings.token_type_embeddings.weight"] = rng.standard_normal((2, H)).astype(
        np.float32
    )
    norm("embeddings.LayerNorm")
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        for k in ("query", "key", "value"):
            lin(f"{p}.attention.self.{k}", H, H)
        lin(f"{p}.attention.output.dense", H, H)
        norm(f"{p}.attention.output.LayerNorm")
        lin(f"{p}.intermediate.dense", INTER, H)
        lin(f"{p}.output.dense", H, INTER)
        norm(f"{p}.output.LayerNorm")
    safetensors_numpy.save_file(t, str(tmp_path / "model.safetensors"))
    config = {
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "intermediate_size": INTER,
        "layer_norm_eps": 1e-12,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return t


@pytest.mark.parametrize("prefix", ["", "bert."])
def test_load_transposes_linear_weights_and_reads_config(tmp_path, prefix):
    t = _checkpoint(tmp_path, prefix)
    params, config = bert.load(tmp_path)
    assert config["num_hidden_layers"] == LAYERS and len(params["layers"]) == LAYERS
    q = params["layers"][1]["query"]
    np.testing.assert_array_equal(
        q["w"], t[f"{prefix}encoder.layer.1.attention.self.query.weight"].T
    )
    assert params["layers"][0]["intermediate"]["w"].shape == (H, INTER)


def test_encode_is_normalised_and_ignores_padding(tmp_path):
    _checkpoint(tmp_path)
    params, config = bert.load(tmp_path)
    ids = np.array([[3, 7, 9, 0, 0], [4, 5, 6, 7, 8]], np.int32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)
    emb = np.asarray(jax.jit(lambda i, m: bert.encode(params, config, i, m))(ids, mask))
    np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, rtol=1e-5)
    # the same sentence without padding gives the same embedding
    short = np.asarray(bert.encode(params, config, ids[:1, :3], mask[:1, :3]))
    np.testing.assert_allclose(short[0], emb[0], atol=1e-5)
    assert not np.allclose(emb[0], emb[1], atol=1e-3)


def test_missing_tensor_is_a_clear_error(tmp_path):
    t = _checkpoint(tmp_path)
    del t["encoder.layer.1.output.dense.bias"]
    safetensors_numpy.save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="no tensor 'encoder.layer.1.output.dense.bias'"):
        bert.load(tmp_path)
