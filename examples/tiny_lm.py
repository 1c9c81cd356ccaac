"""A small GPT, trained here, quantized with jaxq: perplexity, file size and decoding speed.

A byte-level decoder (vocabulary 256; pre-norm blocks with causal multi-head attention and a GELU
MLP, learned positions, output projection tied to the token embedding) written in Flax linen with
its layer stack under ``nn.scan``, so the parameters of every layer are stacked ``[layers, ...]``
as in MaxText. It trains for a few minutes on the English text that ships with Python
(``pydoc_data.topics``, 10% held out) and then decodes with a KV cache in a ``lax.scan`` under
``jax.jit``: a prefill of the prompt writes every layer's cache, and each step writes one
position.

Each variant is ``jaxq.quantize`` of the same float params and functions (scoring, prefill and
generation), calibrated on training windows:

- W8: int8 weights per output channel (rounded to nearest), float activations;
- W8A8: int8 weights and static int8 activations (per tensor, calibrated); + int8 attention:
  the attention products ``Q K^T`` and ``P V`` int8 too, with scales per row computed at run time;
- W4 RTN / GPTQ / AWQ: int4 weights per output channel, rounded to nearest, codes chosen by GPTQ,
  or input channels scaled by AWQ first; the embedding table (shared with the output projection)
  and the position table int8;
- + int8 KV cache: W8 with the decode loop's cache stored int8 (one scale per position and head);
- + int8 embeddings: the token and position tables int8 per row too (the whole file int8).

Perplexity is measured on held-out windows: the first half is prefilled, the second half is
decoded step by step through the KV cache (teacher-forced), and only the decoded tokens are
scored, so the cache's precision counts. Timing: every variant jitted, timed round by round on the
same inputs (``jaxq.compare_timing``), ratios paired per round.

Set up: pip install -e '.[examples]' flax
Run:    python examples/tiny_lm.py --params tiny_lm.msgpack
        (about 12 minutes on 2 cores, 6 of them training; the params file is written after
        training and read by later runs)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxq


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    context: int = 128
    vocab: int = 256

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def corpus(held_out: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``pydoc_data.topics`` as bytes (uint8), split into training and held-out text."""
    from pydoc_data.topics import topics

    data = np.frombuffer("\n\n".join(topics[k] for k in sorted(topics)).encode(), np.uint8)
    cut = int(len(data) * (1 - held_out))
    return data[:cut], data[cut:]


class Block(nn.Module):
    """One pre-norm decoder block. ``x`` holds the tokens at positions ``t, t+1, ...``; their keys
    and values are written into this layer's cache (``[batch, context, heads, head_dim]``) and
    attention reads the cache up to each query's position (a causal mask)."""

    cfg: Config

    @nn.compact
    def __call__(self, carry: tuple[Any, Any], cache: tuple[Any, Any]) -> Any:
        x, t = carry
        k_cache, v_cache = cache
        cfg = self.cfg
        b, s, d = x.shape
        qkv = nn.Dense(3 * d, name="qkv")(nn.LayerNorm(name="ln1")(x))
        q, k, v = (z.reshape(b, s, cfg.heads, cfg.head_dim) for z in jnp.split(qkv, 3, axis=-1))
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, t, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, t, 0, 0))
        scores = jnp.einsum("bshd,bthd->bhst", q, k_cache) / math.sqrt(cfg.head_dim)
        visible = jnp.arange(cfg.context)[None, :] <= (t + jnp.arange(s))[:, None]
        scores = jnp.where(visible, scores, -1e9)
        att = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, axis=-1), v_cache)
        x = x + nn.Dense(d, name="proj")(att.reshape(b, s, d))
        h = nn.LayerNorm(name="ln2")(x)
        x = x + nn.Dense(d, name="fc2")(nn.gelu(nn.Dense(4 * d, name="fc1")(h)))
        return (x, t), (k_cache, v_cache)


class TinyLM(nn.Module):
    """Logits of the tokens at positions ``t ...`` and the updated caches (stacked per layer)."""

    cfg: Config

    @nn.compact
    def __call__(self, tokens: Any, cache: tuple[Any, Any], t: Any) -> tuple[Any, Any]:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.d_model, name="embed")
        pos = self.param("pos", nn.initializers.normal(0.02), (cfg.context, cfg.d_model))
        x = embed(tokens) + jnp.take(pos, t + jnp.arange(tokens.shape[1]), axis=0)
        stack = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=0,
            length=cfg.layers,
        )
        (x, _), cache = stack(cfg, name="layers")((x, t), cache)
        return embed.attend(nn.LayerNorm(name="ln_f")(x)), cache


def empty_cache(cfg: Config, batch: int) -> tuple[Any, Any]:
    z = jnp.zeros((cfg.layers, batch, cfg.context, cfg.heads, cfg.head_dim), jnp.float32)
    return z, z


def functions(cfg: Config, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """The model's entry points, each ``f(params, tokens)``: ``score`` (logits of the second half
    of each window, decoded through the cache), ``prefill`` (the last logits and the caches of a
    prompt) and ``generate`` (greedy continuation of a prompt)."""
    model = TinyLM(cfg)

    def apply(params: Any, tokens: Any, cache: Any, t: Any) -> Any:
        return model.apply({"params": params}, tokens, cache, t)

    def decode(params: Any, cache: Any, first: Any, forced: Any, steps: int) -> Any:
        """``steps`` single-token steps from position ``prompt_len``: the next input is
        ``forced[:, i]`` (teacher forcing) or, with ``forced=None``, the argmax."""

        def step(carry: Any, tok_in: Any) -> Any:
            cache, tok, t = carry
            tok = tok if tok_in is None else tok_in
            logits, cache = apply(params, tok[:, None], cache, t)
            return (cache, jnp.argmax(logits[:, 0], -1).astype(jnp.int32), t + 1), (
                tok,
                logits[:, 0],
            )

        xs = None if forced is None else forced.T
        init = (cache, first, jnp.int32(prompt_len))
        _, (toks, logits) = jax.lax.scan(step, init, xs, length=steps)
        return toks.T, jnp.swapaxes(logits, 0, 1)

    def prefill(params: Any, prompt: Any) -> Any:
        logits, cache = apply(params, prompt, empty_cache(cfg, prompt.shape[0]), jnp.int32(0))
        return logits[:, -1], cache

    def score(params: Any, window: Any) -> Any:
        last, cache = prefill(params, window[:, :prompt_len])
        forced = window[:, prompt_len:-1]
        _, logits = decode(params, cache, forced[:, 0], forced, forced.shape[1])
        return jnp.concatenate([last[:, None], logits], axis=1)  # predicts window[:, P:]

    def generate(params: Any, prompt: Any) -> Any:
        last, cache = prefill(params, prompt)
        first = jnp.argmax(last, -1).astype(jnp.int32)
        return decode(params, cache, first, None, new_tokens)[0]

    return {"apply": apply, "score": score, "prefill": prefill, "generate": generate}


def train(cfg: Config, text: np.ndarray, steps: int, batch: int, seed: int = 0) -> Any:
    """Adam with warm-up and cosine decay on random windows of ``text``; returns the params."""
    import optax

    model = TinyLM(cfg)
    rng = np.random.default_rng(seed)
    tokens = jnp.zeros((batch, cfg.context), jnp.int32)
    params = model.init(jax.random.key(seed), tokens, empty_cache(cfg, batch), 0)["params"]
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-3, min(100, steps // 10 + 1), steps, 3e-4)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    state = opt.init(params)

    def loss_fn(params: Any, windows: Any) -> Any:
        logits, _ = model.apply(
            {"params": params}, windows[:, :-1], empty_cache(cfg, windows.shape[0]), 0
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    @jax.jit
    def update(params: Any, state: Any, windows: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, windows)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    start, losses = time.perf_counter(), []
    for i in range(steps):
        windows = sample_windows(text, cfg.context + 1, batch, rng)
        params, state, loss = update(params, state, windows)
        losses.append(float(loss))
        if (i + 1) % max(1, steps // 10) == 0:
            print(
                f"  step {i + 1:4d}/{steps}  loss {np.mean(losses[-20:]):.3f}  "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    return jax.device_get(params)


def sample_windows(text: np.ndarray, length: int, batch: int, rng: Any) -> np.ndarray:
    starts = rng.integers(0, len(text) - length, size=batch)
    return np.stack([text[s : s + length] for s in starts]).astype(np.int32)


def line_prompts(text: np.ndarray, length: int, n: int) -> list[np.ndarray]:
    """``n`` prompts of ``length`` bytes of prose that end early in a line (the text is wrapped
    at about 70 columns, so a prompt ending late in one is continued by a line break)."""
    raw, found, start = text.tobytes(), [], 0
    while len(found) < n:
        start = raw.find(b". ", start) + 2
        if start < 2 or start + length > len(raw):
            break
        chunk = raw[start - length // 2 : start + length // 2]
        if chunk.count(b"\n") == 1 and chunk[-1:].isalpha() and b"  " not in chunk.strip():
            found.append(np.frombuffer(chunk, np.uint8).astype(np.int32))
            start += length
    return found


def tiled_windows(text: np.ndarray, length: int) -> np.ndarray:
    """Every non-overlapping window of ``length`` tokens."""
    n = len(text) // length
    return text[: n * length].reshape(n, length).astype(np.int32)


def perplexity(fn: Any, params: Any, windows: np.ndarray, prompt_len: int, batch: int) -> float:
    """``exp`` of the mean negative log-likelihood of every window's tokens after the prompt."""
    nll = []
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        logp = jax.nn.log_softmax(fn(params, w), axis=-1)
        nll.append(-np.take_along_axis(np.asarray(logp), w[:, prompt_len:, None], -1))
    return float(np.exp(np.concatenate([x.ravel() for x in nll]).mean()))


def variants(quick: bool) -> dict[str, jaxq.QConfig | None]:
    """The configurations compared (None: float)."""
    from jaxq import QConfig, Rule, Scheme

    int4 = Scheme(bits=4, granularity="channel", narrow_range=True)
    int8_rows = Scheme(bits=8, granularity="channel", narrow_range=True)
    # int8 tables for the int4 models: the lookup and the tied output projection share codes
    tables8 = (
        Rule(primitives={"gather"}, weights=int8_rows),
        Rule(pattern="attend", weights=int8_rows),
    )
    out: dict[str, QConfig | None] = {
        "float": None,
        "W8": QConfig(activations=None),
        "W8A8": QConfig(),
        "W8A8 + int8 attention": QConfig(attention=Scheme(granularity="token")),
        "W4 RTN (emb int8)": QConfig(weights=int4, activations=None, rules=tables8),
        "W4 GPTQ (emb int8)": QConfig(
            weights=int4, activations=None, weight_calibration="gptq", rules=tables8
        ),
        "W4 AWQ (emb int8)": QConfig(
            weights=int4, activations=None, weight_calibration="awq", rules=tables8
        ),
        "W8 + int8 KV": QConfig(activations=None, kv_cache=True),
        "W8 + int8 KV + int8 emb": QConfig(
            activations=None, kv_cache=True, rules=(Rule(primitives={"gather"}),)
        ),
    }
    if quick:
        out = {k: v for k, v in out.items() if k in ("float", "W8", "W4 GPTQ (emb int8)")}
    return out


def nbytes(tree: Any) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="training steps (batch 32)")
    ap.add_argument(
        "--params",
        help="load float params from this file (skips training), or save them there after training",
    )
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds per variant")
    ap.add_argument(
        "--quick", action="store_true", help="a tiny model, few variants, batch 1 timed (tests)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        cfg, batch, steps, prompt_len, new_tokens = Config(2, 32, 2, 32), 8, args.steps, 16, 8
    else:
        cfg, batch, steps, prompt_len, new_tokens = Config(), 32, args.steps, 64, 48
    train_text, held_text = corpus()
    print(f"pydoc_data.topics: {len(train_text)} training bytes, {len(held_text)} held out")
    print(f"model: {cfg}")

    from flax import serialization

    template = TinyLM(cfg).init(
        jax.random.key(0), jnp.zeros((1, 1), jnp.int32), empty_cache(cfg, 1), 0
    )["params"]
    if args.params and __import__("os").path.exists(args.params):
        with open(args.params, "rb") as fh:
            params = serialization.from_bytes(template, fh.read())
        print(f"float params loaded from {args.params}")
    else:
        print(f"training {steps} steps, batch {batch} x {cfg.context} bytes:")
        params = train(cfg, train_text, steps, batch)
        if args.params:
            with open(args.params, "wb") as fh:
                fh.write(serialization.to_bytes(params))
    params = jax.tree.map(np.asarray, params)

    fns = functions(cfg, prompt_len, new_tokens)
    rng = np.random.default_rng(1)
    calib = [sample_windows(train_text, cfg.context, 16, rng) for _ in range(8)]
    windows = tiled_windows(held_text, cfg.context)
    if args.quick:
        windows = windows[:32]
    prompts = {b: windows[:b, :prompt_len] for b in ((1,) if args.quick else (1, 8))}

    results: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, Any]] = {}  # variant -> function name -> (jitted fn, params)
    float_bytes = nbytes(params)
    for name, config in variants(args.quick).items():
        start = time.perf_counter()
        if config is None:
            fs = {k: (jax.jit(fns[k]), params) for k in ("score", "prefill", "generate")}
        else:
            fs = {}
            for k in ("score", "prefill", "generate"):
                data = [(w,) if k == "score" else (w[:, :prompt_len],) for w in calib]
                # (a prefill writes the cache but never reads it back: no cache to quantize)
                cfg_k = dataclasses.replace(config, kv_cache=config.kv_cache and k != "prefill")
                qf = jaxq.quantize(fns[k], params, calibration=data, config=cfg_k, progress=False)
                fs[k] = (jax.jit(qf.apply), qf.params)
        f, p = fs["score"]
        ppl = perplexity(f, p, windows, prompt_len, 64)
        results[name] = {"ppl": ppl, "bytes": nbytes(p), "seconds": time.perf_counter() - start}
        runs[name] = fs
        print(f"  {name:26s} perplexity {ppl:.4f}  ({results[name]['seconds']:.0f} s)", flush=True)

    for b, prompt in prompts.items():
        # one round-robin over every (variant, prefill / generation): each round's decoding time
        # is its generation minus its prefill, and ratios are paired per round
        table = jaxq.compare_timing(
            {
                f"{name} / {kind}": functools.partial(_call, runs[name][kind])
                for name in runs
                for kind in ("prefill", "generate")
            },
            prompt,
            rounds=args.rounds,
        )
        per_round = {
            name: {k: np.asarray(table[f"{name} / {k}"].times) for k in ("prefill", "generate")}
            for name in runs
        }
        base = per_round["float"]
        for name, t in per_round.items():
            r = results[name]
            decode = t["generate"] - t["prefill"]
            r[f"prefill_tok_s_b{b}"] = b * prompt_len / float(np.median(t["prefill"]))
            r[f"prefill_speedup_b{b}"] = float(np.median(base["prefill"] / t["prefill"]))
            r[f"decode_tok_s_b{b}"] = b * new_tokens / float(np.median(decode))
            r[f"decode_speedup_b{b}"] = float(
                np.median((base["generate"] - base["prefill"]) / decode)
            )

    columns = [(k, b) for k in ("prefill", "decode") for b in prompts]
    head = f"{'variant':26s} {'ppl':>7s} {'change':>8s} {'bytes':>7s}  " + "  ".join(
        f"{f'{k} b{b}':>13s}" for k, b in columns
    )
    print(
        f"\nheld-out perplexity (first {prompt_len} bytes of each {cfg.context}-byte window "
        f"prefilled, the rest decoded through the KV cache); tokens/s: medians of {args.rounds} "
        "interleaved rounds, (x) = speed-up vs float paired per round"
    )
    print(head)
    print("-" * len(head))
    for name, r in results.items():
        r["change"] = r["ppl"] / results["float"]["ppl"] - 1
        r["bytes_share"] = r["bytes"] / float_bytes
        cells = [f"{r[f'{k}_tok_s_b{b}']:6.0f} ({r[f'{k}_speedup_b{b}']:.2f}x)" for k, b in columns]
        print(
            f"{name:26s} {r['ppl']:7.4f} {100 * r['change']:+7.2f}% {100 * r['bytes_share']:6.1f}%  "
            + "  ".join(f"{c:>13s}" for c in cells)
        )
    print(
        f"(float params: {float_bytes / 1e6:.2f} MB; decode tokens/s from the generation of "
        f"{new_tokens} tokens minus the prefill)"
    )

    print("\ngreedy continuations (held-out prompts):")
    for prompt in line_prompts(held_text, prompt_len, 2):
        print(f"  prompt {bytes(prompt.astype(np.uint8))!r}")
        for name in runs:
            f, p = runs[name]["generate"]
            out = np.asarray(f(p, prompt[None]))[0].astype(np.uint8)
            print(f"    {name:26s} {bytes(out).decode('utf-8', 'replace')!r}")
    return results


def _call(fp: tuple[Any, Any], prompt: Any) -> Any:
    f, p = fp
    return f(p, prompt)


if __name__ == "__main__":
    main()
