"""Per-layer error and sensitivity: find the few layers to keep in float (or at more bits) to meet an
accuracy target.

``layer_sqnr`` measures, on a sample batch, the signal-to-quantization-noise ratio of every quantized
layer's output (fake-quantized program against float, both compiled); errors of earlier layers
accumulate into it, which is what a user sees at that layer. ``sensitivity`` needs each layer's own
harm instead: it quantizes one layer at a time and measures the SQNR of the model's output, ranks
layers worst first, then keeps the worst ones in float (or gives them a ``fallback`` rule: 8-bit
weights in a 4-bit model, say), one more at a time, re-quantizing until the user's metric reaches
the target (or ``max_kept`` layers are kept), and says which it kept.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from jaxq.quantize._api import QuantizedFunction, quantize, sqnr_db
from jaxq.quantize._calibrate import check_batches
from jaxq.quantize._config import INHERIT, QConfig, Rule


def layer_sqnr(
    f: Callable[..., Any], simulated: QuantizedFunction, *sample: Any
) -> dict[str, float]:
    """SQNR (dB) of each quantized layer's output on ``sample`` (see
    ``QuantizedFunction.layer_sqnr``); ``f`` is accepted for symmetry with ``sensitivity``."""
    del f
    if simulated.mode != "simulate":
        raise ValueError("layer_sqnr: needs a QuantizedFunction made with mode='simulate'")
    return simulated.layer_sqnr(*sample)


@dataclasses.dataclass(frozen=True)
class SensitivityResult:
    """The chosen function, the layers kept (worst first) and every step taken.

    Attributes:
      function: the chosen :class:`QuantizedFunction` (the last one tried).
      kept: the names of the layers given the fallback, most harmful first.
      fallback: the rule they got (``Rule(skip=True)``: float).
      metric: ``metric(function)``.
      target: the target asked for.
      met: whether ``metric >= target``.
      sqnr_db: per-layer SQNR (dB) of each layer's output against float, all layers quantized.
      history: ``(layers kept, metric)`` for every step, in order.
      isolated_sqnr_db: per layer, the SQNR (dB) of the model's output with only that layer
        quantized (in the config's scheme): the ranking behind ``kept``.
      config: the config of ``function`` (the given one with a rule per kept layer first):
        ``jaxq.quantize(f, params, calibration=..., config=result.config)`` makes it again,
        e.g. for new params or another mode, without searching again.
    """

    function: QuantizedFunction
    kept: tuple[str, ...]
    fallback: Rule
    metric: float
    target: float
    met: bool
    sqnr_db: dict[str, float]
    history: tuple[tuple[int, float], ...]  # (layers kept, metric)
    isolated_sqnr_db: dict[str, float]  # model-output SQNR with only that layer quantized
    config: QConfig

    @property
    def kept_float(self) -> tuple[str, ...]:
        """The kept layers if the fallback is float, else none."""
        return self.kept if self.fallback.skip else ()

    def _how(self) -> str:
        if self.fallback.skip:
            return "in float"
        given = [f"{k}={getattr(self.fallback, k)!r}" for k in _FIELDS if _given(self.fallback, k)]
        return f"at {', '.join(given)}"

    def __str__(self) -> str:
        how = self._how()
        lines = [
            f"sensitivity: target {self.target:g}, reached {self.metric + 0.0:g} "
            f"({'met' if self.met else 'NOT met'}) keeping {len(self.kept)} layer(s) {how}"
        ]
        lines += [
            f"  kept {how}: {n}  (output SQNR with only it quantized: "
            f"{self.isolated_sqnr_db.get(n, math.nan):.1f} dB)"
            for n in self.kept
        ]
        lines += [f"  {k} kept -> metric {m:g}" for k, m in self.history]
        return "\n".join(lines)


def sensitivity(
    f: Callable[..., Any],
    params: Any = None,
    *,
    calibration: Iterable[Any],
    metric: Callable[[QuantizedFunction], float],
    target: float,
    config: QConfig | None = None,
    fallback: Rule | None = None,
    max_kept: int | None = None,
    mode: str = "realize",
    sample: Any = None,
) -> SensitivityResult:
    """Quantize ``f``, keeping its most harmful layers in float (or giving them ``fallback``) until
    ``metric(qf) >= target``.

    Args:
      f, params, calibration, config, mode: as for ``jaxq.quantize`` (with ``params``, ``f`` is
        called as ``f(params, *args)``).
      metric: scores a quantized function, higher is better (e.g. validation accuracy).
      target: the score to reach.
      fallback: what the kept layers get: a ``Rule`` without ``pattern`` or ``primitives``
        (each kept layer gets it with a pattern naming that layer), e.g.
        ``Rule(weights=Scheme(bits=8, granularity="channel"))`` for 8-bit weights in a 4-bit
        model, or 8 bits where ONNX Runtime runs 7-bit weights fastest. Default: float
        (``Rule(skip=True)``).
      max_kept: at most this many layers are kept (default: all of them, if needed).
      sample: arguments for measuring per-layer SQNR, a tuple (or one array: the only
        argument; default: the first calibration tuple).
    """
    config = QConfig() if config is None else config
    fallback = Rule(skip=True) if fallback is None else fallback
    if not isinstance(fallback, Rule) or fallback.pattern is not None or fallback.primitives:
        raise ValueError(
            f"sensitivity: fallback must be a Rule without pattern or primitives (each kept layer "
            f"gets it with a pattern of its own), e.g. Rule(weights=Scheme(bits=8)); got "
            f"{fallback!r}"
        )
    if not fallback.skip and not any(_given(fallback, k) for k in _FIELDS):
        raise ValueError(
            "sensitivity: the fallback rule changes nothing; give it weights, activations or "
            "smoothing (or skip=True: float)"
        )
    check_batches(calibration, "sensitivity: calibration")
    batches = [b if isinstance(b, tuple) else (b,) for b in calibration]
    if not batches:
        raise ValueError("sensitivity: calibration is empty; pass at least one argument tuple")
    if max_kept is not None and (not isinstance(max_kept, int) or max_kept < 0):
        raise ValueError(f"sensitivity: max_kept must be an int >= 0 or None; got {max_kept!r}")
    sample = batches[0] if sample is None else sample if isinstance(sample, tuple) else (sample,)
    simulated = quantize(
        f, params, calibration=batches, config=config, mode="simulate", progress=False
    )
    sqnr = layer_sqnr(f, simulated, *sample)
    isolated = _isolated_sqnr(
        f,
        params,
        batches,
        config,
        sample,
        [r.name for r in simulated.report().layers if r.status == "quantized"],
    )
    ranked = sorted(isolated, key=lambda n: isolated[n])
    limit = len(ranked) if max_kept is None else min(max_kept, len(ranked))
    history: list[tuple[int, float]] = []
    qf: QuantizedFunction | None = None
    cfg = config
    score = -math.inf
    for k in range(limit + 1):
        kept = tuple(dataclasses.replace(fallback, pattern=f"^{re.escape(n)}$") for n in ranked[:k])
        cfg = dataclasses.replace(config, rules=kept + tuple(config.rules))
        qf = quantize(f, params, calibration=batches, config=cfg, mode=mode, progress=False)
        score = float(metric(qf))
        history.append((k, score))
        if score >= target:
            break
    assert qf is not None
    return SensitivityResult(
        qf,
        tuple(ranked[: history[-1][0]]),
        fallback,
        score,
        target,
        score >= target,
        sqnr,
        tuple(history),
        isolated,
        cfg,
    )


_FIELDS = ("weights", "activations", "smoothing")


def _given(rule: Rule, field: str) -> bool:
    return getattr(rule, field) is not INHERIT


def _only(config: QConfig, names: list[str], keep: str) -> QConfig:
    others = [re.escape(n) for n in names if n != keep]
    rules = (Rule(pattern=f"^({'|'.join(others)})$", skip=True),) if others else ()
    return dataclasses.replace(config, rules=rules + tuple(config.rules))


def _isolated_sqnr(
    f: Callable[..., Any],
    params: Any,
    batches: list[tuple[Any, ...]],
    config: QConfig,
    sample: tuple[Any, ...],
    names: list[str],
) -> dict[str, float]:
    """Model-output SQNR with only one layer quantized, for each layer (lower: more harmful)."""
    ref = jax.tree.leaves(jax.jit(f)(*sample) if params is None else jax.jit(f)(params, *sample))
    out = {}
    for name in names:
        qf = quantize(
            f,
            params,
            calibration=batches,
            config=_only(config, names, name),
            mode="simulate",
            progress=False,
        )
        got = jax.tree.leaves(jax.jit(qf)(*sample))
        out[name] = sqnr_db(
            np.concatenate([np.ravel(r) for r in ref]), np.concatenate([np.ravel(g) for g in got])
        )
    return out
