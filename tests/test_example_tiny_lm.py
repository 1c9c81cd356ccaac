"""examples/tiny_lm.py on a very small config: a Flax decoder whose layer stack runs under
``nn.scan``, trained a few steps, quantized, scored through its int8 KV cache and decoded."""

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

_spec = importlib.util.spec_from_file_location(
    "tiny_lm_example", pathlib.Path(__file__).parents[1] / "examples" / "tiny_lm.py"
)
tiny_lm = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tiny_lm  # (its dataclasses look their module up)
_spec.loader.exec_module(tiny_lm)


def test_the_example_runs_end_to_end(tmp_path, capsys):
    ckpt = tmp_path / "lm.msgpack"
    results = tiny_lm.main(["--quick", "--steps", "20", "--rounds", "1", "--params", str(ckpt)])
    assert ckpt.exists()  # saved after training; a second run would load it
    assert set(results) == {"float", "W8", "W4 GPTQ (emb int8)"}
    base = results["float"]
    assert 1 < base["ppl"] < 256  # learnt something beyond uniform bytes
    assert abs(results["W8"]["change"]) < 0.02
    assert abs(results["W4 GPTQ (emb int8)"]["change"]) < 0.1
    assert results["W8"]["bytes_share"] < 0.35  # float norms and biases weigh more when tiny
    assert results["W4 GPTQ (emb int8)"]["bytes_share"] < results["W8"]["bytes_share"]
    out = capsys.readouterr().out
    assert "greedy continuations" in out and "decode b1" in out  # (quick: batch 1 only)


def test_a_kv_cache_decoder_under_nn_scan_is_quantized_per_layer():
    """The int8 KV cache is carried as codes through the decode loop and sliced per layer by
    the layer scan; the stacked weights are int8 with per-layer scales; realize equals
    simulate on the scores."""
    import jaxq
    from jaxq.quantize._report import sqnr_db

    cfg = tiny_lm.Config(layers=2, d_model=16, heads=2, context=16)
    init = jax.jit(tiny_lm.TinyLM(cfg).init, static_argnums=3)  # (untrained: compiles no step)
    empty = tiny_lm.empty_cache(cfg, 1)
    params = jax.tree.map(np.asarray, init(jax.random.key(0), np.zeros((1, 1), np.int32), empty, 0))
    params = params["params"]
    fns = tiny_lm.functions(cfg, prompt_len=8, new_tokens=4)
    rng = np.random.default_rng(0)
    text = tiny_lm.corpus()[1]
    cal = [(tiny_lm.sample_windows(text, cfg.context, 4, rng),) for _ in range(2)]
    window = cal[0][0]
    config = jaxq.QConfig(kv_cache=True)
    qf = jaxq.quantize(fns["score"], params, calibration=cal, config=config, progress=False)
    sim = jaxq.quantize(
        fns["score"], params, calibration=cal, config=config, mode="simulate", progress=False
    )
    qkv = qf.params["layers"]["qkv"]["kernel"]
    assert isinstance(qkv, jaxq.QArray) and qkv.layers == 2 and qkv.codes.dtype == np.int8
    loops = [e for e in qf.specialize(window).equations() if e.primitive == "scan"]
    carried = {(str(a.dtype), tuple(a.shape)) for loop in loops for a in loop.in_avals}
    assert ("int8", (2, 4, cfg.context, 2, 8)) in carried  # the stacked cache, as codes
    got = np.asarray(jax.jit(qf.apply)(qf.params, window))
    # (integer and float dots round apart, and a flipped activation code travels through the
    # cache and the later steps: close, not equal)
    assert sqnr_db(np.asarray(jax.jit(sim)(window)), got) > 30
    ref = np.asarray(jax.jit(fns["score"])(params, window))
    assert sqnr_db(ref, got) > 25
    # (untrained, many top-2 logits lie closer together than int8's error, where either order
    # is right: 27 of 32 positions agreed on an H200, 31 on a CPU; where float's top-1 leads by
    # more than twice the error, int8 picks it)
    top2 = np.sort(ref, -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * np.abs(got - ref).max(-1)
    assert clear.mean() > 0.5 and (np.argmax(got, -1) == np.argmax(ref, -1))[clear].all()
