"""A small BERT encoder in plain JAX, loading Hugging Face ``BertModel`` safetensors checkpoints.

Enough for sentence-transformers models such as all-MiniLM-L6-v2: embeddings, post-LayerNorm
encoder layers with GELU (erf) MLPs, mean pooling over the attention mask and L2 normalisation.
Named scopes follow the checkpoint's module paths (``encoder/layer_0/attention/query``), so jaxq's
equation names, quantization rules and reports read like the model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]


def load(model_dir: str | Path) -> tuple[Params, dict[str, Any]]:
    """Read ``config.json`` and ``model.safetensors`` into a params tree of numpy arrays.

    Linear weights are stored transposed (``(in, out)``) so layers compute ``x @ w + b``.
    """
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    flat = load_file(str(model_dir / "model.safetensors"))
    flat = {k.removeprefix("bert."): v for k, v in flat.items()}

    def get(name: str) -> np.ndarray:
        if name not in flat:
            raise KeyError(f"checkpoint {model_dir} has no tensor {name!r}; is it a BertModel?")
        return np.asarray(flat[name], np.float32)

    def linear(prefix: str) -> dict[str, np.ndarray]:
        return {"w": get(f"{prefix}.weight").T.copy(), "b": get(f"{prefix}.bias")}

    def norm(prefix: str) -> dict[str, np.ndarray]:
        return {"scale": get(f"{prefix}.weight"), "bias": get(f"{prefix}.bias")}

    params: Params = {
        "embeddings": {
            "word": get("embeddings.word_embeddings.weight"),
            "position": get("embeddings.position_embeddings.weight"),
            "token_type": get("embeddings.token_type_embeddings.weight"),
            "norm": norm("embeddings.LayerNorm"),
        },
        "layers": [],
    }
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        params["layers"].append(
            {
                "query": linear(f"{p}.attention.self.query"),
                "key": linear(f"{p}.attention.self.key"),
                "value": linear(f"{p}.attention.self.value"),
                "attn_out": linear(f"{p}.attention.output.dense"),
                "attn_norm": norm(f"{p}.attention.output.LayerNorm"),
                "intermediate": linear(f"{p}.intermediate.dense"),
                "output": linear(f"{p}.output.dense"),
                "out_norm": norm(f"{p}.output.LayerNorm"),
            }
        )
    return params, config


def _dense(p: dict[str, Any], x: jax.Array, name: str) -> jax.Array:
    with jax.named_scope(name):
        return x @ p["w"] + p["b"]


def _layer_norm(p: dict[str, Any], x: jax.Array, eps: float, name: str) -> jax.Array:
    with jax.named_scope(name):
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def encode(params: Params, config: dict[str, Any], ids: jax.Array, mask: jax.Array) -> jax.Array:
    """Token ids and attention mask ``(B, T)`` -> L2-normalised sentence embeddings ``(B, H)``."""
    eps = config.get("layer_norm_eps", 1e-12)
    heads = config["num_attention_heads"]
    b, t = ids.shape
    emb = params["embeddings"]
    with jax.named_scope("embeddings"):
        x = jnp.take(jnp.asarray(emb["word"]), ids, axis=0)
        x = x + jnp.asarray(emb["position"])[:t][None] + jnp.asarray(emb["token_type"])[0]
        x = _layer_norm(emb["norm"], x, eps, "norm")
    bias = jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
    head_dim = config["hidden_size"] // heads

    def split(v: jax.Array) -> jax.Array:
        return v.reshape(b, t, heads, head_dim).transpose(0, 2, 1, 3)

    for i, lp in enumerate(params["layers"]):
        with jax.named_scope(f"encoder/layer_{i}"):
            with jax.named_scope("attention"):
                q = split(_dense(lp["query"], x, "query"))
                k = split(_dense(lp["key"], x, "key"))
                v = split(_dense(lp["value"], x, "value"))
                scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(head_dim) + bias
                ctx = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)
                ctx = ctx.transpose(0, 2, 1, 3).reshape(b, t, heads * head_dim)
                x = _layer_norm(
                    lp["attn_norm"], x + _dense(lp["attn_out"], ctx, "output"), eps, "norm"
                )
            with jax.named_scope("mlp"):
                y = jax.nn.gelu(_dense(lp["intermediate"], x, "intermediate"), approximate=False)
                x = _layer_norm(lp["out_norm"], x + _dense(lp["output"], y, "output"), eps, "norm")
    with jax.named_scope("pool"):
        m = mask[..., None].astype(x.dtype)
        pooled = (x * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)
        return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


def tokenize(
    tokenizer_path: str | Path, sentences: list[str], length: int
) -> tuple[np.ndarray, ...]:
    """Pad/truncate to a fixed ``length`` so one compiled function serves every batch."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.enable_truncation(length)
    tok.enable_padding(length=length)
    enc = tok.encode_batch(sentences)
    ids = np.array([e.ids for e in enc], np.int32)
    mask = np.array([e.attention_mask for e in enc], np.int32)
    return ids, mask
