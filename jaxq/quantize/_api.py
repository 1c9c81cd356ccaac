"""``jaxq.quantize``: annotate, calibrate and realize composed into an ordinary JAX function."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxq._program import Program, trace
from jaxq._taps import intermediates
from jaxq.quantize._annotate import annotate_program, prepare, unmatched_rules
from jaxq.quantize._calibrate import calibrate_program
from jaxq.quantize._config import QConfig
from jaxq.quantize._lower import (
    QState,
    QuantizeError,
    get_state,
    lower,
    simulate_handler,
    with_state,
)
from jaxq.quantize._realize import realize_handler, realize_program

MODES = ("realize", "simulate")


# ---- report -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """One row of :class:`Report`. Later columns (e.g. SQNR) go after ``status``."""

    name: str
    primitive: str
    status: str  # "quantized", or why the layer stays float
    weights: str | None = None
    activations: str | None = None
    weight_scale: tuple[float, float] | None = None  # (min, max) over channels / groups
    activation_scale: float | None = None
    activation_zero_point: int | None = None
    rule: int | None = None
    sqnr_db: float | None = None  # of the layer's output against float, on a sample batch


@dataclasses.dataclass(frozen=True)
class Report:
    """What was quantized, and how. ``str(report)`` is a table; ``report.to_dict()`` the data."""

    mode: str
    layers: tuple[LayerReport, ...]
    unmatched_rules: tuple[str, ...]
    calibration: dict[str, Any]
    param_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "layers": [dataclasses.asdict(r) for r in self.layers],
            "unmatched_rules": list(self.unmatched_rules),
            "calibration": dict(self.calibration),
            "param_bytes": self.param_bytes,
        }

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """The report as JSON (infinite SQNR, for exact layers, is written as null)."""
        data = self.to_dict()
        for row in data["layers"]:
            if row["sqnr_db"] is not None and not math.isfinite(row["sqnr_db"]):
                row["sqnr_db"] = None
        text = json.dumps(data, indent=2, default=str)
        if path is not None:
            Path(path).write_text(text)
        return text

    def save_plot(self, path: str | os.PathLike[str]) -> Path:
        """A PNG bar chart of per-layer SQNR, worst first (needs matplotlib: ``jaxq[plot]``)."""
        rows = [r for r in self.layers if r.sqnr_db is not None and math.isfinite(r.sqnr_db)]
        values = [float(r.sqnr_db) for r in rows if r.sqnr_db is not None]
        if not rows:
            raise ValueError("save_plot: no SQNR in this report; call qf.report(sample=(x,))")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("save_plot needs matplotlib: pip install 'jaxq[plot]'") from e
        fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
        ax.barh(
            [r.name for r in rows],
            values,
            color=["#c0392b" if v < 20 else "#2e86c1" for v in values],
        )
        ax.invert_yaxis()
        ax.set_xlabel("SQNR of the layer output vs float (dB, higher is better)")
        ax.set_title(f"jaxq.quantize per-layer SQNR ({self.mode})")
        ax.tick_params(axis="y", labelsize=8)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def __str__(self) -> str:
        head = (
            "layer",
            "primitive",
            "weights",
            "activations",
            "w scale",
            "a scale",
            "SQNR dB",
            "status",
        )
        rows = []
        for r in self.layers:
            ws = (
                ""
                if r.weight_scale is None
                else f"{r.weight_scale[0]:.3g}..{r.weight_scale[1]:.3g}"
            )
            a_s = "" if r.activation_scale is None else f"{r.activation_scale:.3g}"
            sq = "" if r.sqnr_db is None else f"{r.sqnr_db:.1f}"
            rows.append(
                (
                    r.name,
                    r.primitive,
                    r.weights or "float",
                    r.activations or "float",
                    ws,
                    a_s,
                    sq,
                    r.status,
                )
            )
        widths = [
            max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
            for i, h in enumerate(head)
        ]
        fmt = "  ".join(f"{{:{w}}}" for w in widths)
        lines = [f"jaxq.quantize report (mode={self.mode}, parameter bytes={self.param_bytes})"]
        lines.append(fmt.format(*head))
        lines.append(fmt.format(*("-" * w for w in widths)))
        lines += [fmt.format(*row) for row in rows]
        if self.calibration:
            lines.append(f"calibration: {self.calibration}")
        if self.unmatched_rules:
            lines.append("rules that matched nothing:")
            lines += [f"  {u}" for u in self.unmatched_rules]
        return "\n".join(lines)


def param_bytes(program: Program) -> int:
    return int(sum(np.asarray(c).nbytes for c in program.jaxpr.consts if hasattr(c, "shape")))


def sqnr_db(reference: Any, approx: Any) -> float:
    """``10 log10(sum(ref^2) / sum((ref - approx)^2))`` in dB; infinite when they are equal."""
    ref = np.asarray(reference, np.float64)
    noise = float(np.sum((ref - np.asarray(approx, np.float64)) ** 2))
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(float(np.sum(ref**2)), 1e-300) / noise)


def _worst_first(rows: list[LayerReport]) -> list[LayerReport]:
    measured = sorted(
        (r for r in rows if r.sqnr_db is not None), key=lambda r: float(r.sqnr_db or 0)
    )
    return measured + [r for r in rows if r.sqnr_db is None]


def make_report(program: Program, sqnr: dict[str, float] | None = None) -> Report:
    state = get_state(program, "report")
    rows = []
    for e in state.source.equations():
        site = state.sites.get(e.name)
        if site is None:
            if e.name in state.skipped:
                rows.append(LayerReport(e.name, e.primitive, state.skipped[e.name]))
            continue
        qw = state.weights.get(e.name)
        wscale = None
        if qw is not None:
            src = qw.group_scale if qw.group_scale is not None else qw.scale
            wscale = (float(np.min(src)), float(np.max(src)))
        acts = None
        a_scale = a_zp = None
        status = "quantized"
        if site.activations is not None:
            params = state.act.get(e.name)
            if params is not None:
                kind = "static"
                a_scale, a_zp = params.scale, params.zero_point
            elif state.config.dynamic:
                kind = "dynamic"
            else:
                kind = "dynamic (inside a loop)" if site.in_loop else "dynamic (not calibrated)"
            acts = f"{site.activations.short()} {kind}"
        rows.append(
            LayerReport(
                e.name,
                e.primitive,
                status,
                site.weights.short()
                + (f" {qw.method}" if qw and qw.method != "minmax" else "")
                + (" smoothed" if e.name in state.act_absmax else ""),
                acts,
                wscale,
                a_scale,
                a_zp,
                site.rule,
                None if sqnr is None else sqnr.get(e.name),
            )
        )
    return Report(
        mode=state.mode,
        layers=tuple(rows if sqnr is None else _worst_first(rows)),
        unmatched_rules=tuple(unmatched_rules(state.config, state.matched_rules)),
        calibration=dict(state.calibration),
        param_bytes=param_bytes(program),
    )


# ---- the function -------------------------------------------------------------------------------


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.result_type(x))


class QuantizedFunction:
    """A quantized JAX function: call it like the original (without the ``weight_argnums``).

    It works under ``jax.jit``, ``jax.vmap`` and (in simulate mode) ``jax.grad``. New input shapes
    re-trace the original function and reuse the calibrated scales and quantized weights, matched
    by equation name.

    Attributes:
      program: the quantized Program at the example shapes.
      mode: ``"realize"`` or ``"simulate"``.
    """

    def __init__(self, fun: Callable[..., Any], program: Program, mode: str) -> None:
        self._fun = fun
        self.program = program
        self.mode = mode
        self._state: QState = get_state(program, "QuantizedFunction")
        self._cache: dict[Any, Program] = {
            self._key(program.in_tree, program.jaxpr.in_avals): program
        }
        self.__name__ = getattr(fun, "__name__", "quantized")
        self.__doc__ = getattr(fun, "__doc__", None)

    @staticmethod
    def _key(tree: Any, specs: Any) -> Any:
        return tree, tuple((tuple(s.shape), np.dtype(s.dtype)) for s in specs)

    def specialize(self, *args: Any, **kwargs: Any) -> Program:
        """The quantized Program for arguments of these shapes (traced once per shape)."""
        leaves, tree = jax.tree.flatten((args, kwargs))
        specs = [_spec(x) for x in leaves]
        key = self._key(tree, specs)
        prog = self._cache.get(key)
        if prog is None:
            a, k = jax.tree.unflatten(tree, specs)
            source = prepare(trace(self._fun, *a, **k))
            state = self._state.replace(source=source)
            handler = realize_handler(state) if self.mode == "realize" else simulate_handler(state)
            prog, engine = lower(state, handler, integer_chains=self.mode == "realize")
            state = state.replace(
                sites=engine.sites, skipped=engine.skipped, weights=engine.weights
            )
            prog = with_state(prog, state)
            self._cache[key] = prog
        return prog

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.specialize(*args, **kwargs).as_fun()(*args, **kwargs)

    def _simulated(self, *args: Any, **kwargs: Any) -> tuple[Program, Program]:
        """(float program, fake-quantized program) at these argument shapes, sharing names."""
        if self.mode == "simulate":
            prog = self.specialize(*args, **kwargs)
            return get_state(prog, "layer_sqnr").source, prog
        source = prepare(trace(self._fun, *args, **kwargs))
        state = self._state.replace(source=source)
        prog, _ = lower(state, simulate_handler(state))
        return source, prog

    def layer_sqnr(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """SQNR (dB) of each quantized layer's output against float on these arguments.

        Measured on the fake-quantized program, which realize matches exactly in its integer
        results; errors of earlier layers accumulate into later ones, as a user sees them. Layers
        inside loops or branches have no single value and are left out.
        """
        source, sim = self._simulated(*args, **kwargs)
        quantized = {r.name for r in make_report(self.program).layers if r.status == "quantized"}
        top = {e.name for e in sim.equations() if len(e.path) == 1}
        names = [
            e.name
            for e in source.equations()
            if len(e.path) == 1 and e.name in quantized and e.name in top
        ]
        ref = intermediates(source, names, *args, **kwargs)
        got = intermediates(sim, names, *args, **kwargs)
        return {n: sqnr_db(ref[n], got[n]) for n in names}

    def report(self, sample: tuple[Any, ...] | None = None) -> Report:
        """What was quantized and how; with ``sample`` (a tuple of arguments) also the SQNR of
        every quantized layer, rows sorted worst first."""
        if sample is None:
            return make_report(self.program)
        sample = sample if isinstance(sample, tuple) else (sample,)
        return make_report(self.program, self.layer_sqnr(*sample))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save the quantized program at its example shapes (int8 weights as int8, int4 packed) to
        one safetensors file; ``jaxq.load(path)`` runs it without the model code."""
        return self.program.save(path)

    def __repr__(self) -> str:
        return f"<jaxq.QuantizedFunction {self.__name__} mode={self.mode}>"


def _bind_weights(
    f: Callable[..., Any], weight_argnums: tuple[int, ...], full_args: tuple[Any, ...]
) -> Callable[..., Any]:
    weights = {i: full_args[i] for i in weight_argnums}
    n = len(full_args)

    def fun(*rest: Any, **kwargs: Any) -> Any:
        it = iter(rest)
        args = [weights[i] if i in weights else next(it) for i in range(n)]
        return f(*args, *it, **kwargs)

    fun.__name__ = getattr(f, "__name__", "f")
    return fun


def quantize(
    f: Callable[..., Any],
    *,
    calibration: Iterable[Any] | None = None,
    config: QConfig | None = None,
    mode: str = "realize",
    weight_argnums: int | Iterable[int] = (),
    example_args: tuple[Any, ...] | None = None,
    progress: bool = True,
) -> QuantizedFunction:
    """Quantize ``f``: annotate, calibrate and (in ``"realize"`` mode) lower to integer code.

    Args:
      f: the function. Weights are the arrays it closes over (``functools.partial(model.apply,
        params)``) and the arguments at ``weight_argnums``.
      calibration: an iterable of argument tuples of ``f`` (a bare array stands for a 1-tuple).
        Needed for static activation scales; not for ``QConfig(dynamic=True)`` or weight-only.
      config: a :class:`QConfig` (default: W8 per channel, A8 per tensor, min/max).
      mode: ``"realize"`` (integer code) or ``"simulate"`` (fake quantization; QAT with
        ``jax.grad``).
      weight_argnums: positions of ``f``'s arguments that are weights. Their values come from
        ``example_args`` (or the first calibration tuple); the returned function does not take
        them.
      example_args: arguments of ``f`` to trace with (default: the first calibration tuple).
      progress: show a progress bar over calibration batches.
    """
    if not callable(f):
        raise TypeError(f"quantize: f must be callable; got {type(f).__name__}")
    config = QConfig() if config is None else config
    if not isinstance(config, QConfig):
        raise TypeError(f"quantize: config must be a jaxq.QConfig; got {type(config).__name__}")
    if mode not in MODES:
        raise ValueError(f"quantize: mode must be one of {MODES}; got {mode!r}")
    wa = (weight_argnums,) if isinstance(weight_argnums, int) else tuple(weight_argnums)
    if not all(isinstance(i, int) and i >= 0 for i in wa):
        raise ValueError(
            f"quantize: weight_argnums must be non-negative ints; got {weight_argnums!r}"
        )
    batches: Iterable[Any] | None = None
    first = None
    if calibration is not None:
        if isinstance(calibration, (str, bytes)) or not isinstance(calibration, Iterable):
            raise TypeError(
                "quantize: calibration must be an iterable of argument tuples; got "
                f"{type(calibration).__name__}"
            )
        it = iter(calibration)
        try:
            first = next(it)
        except StopIteration:
            raise QuantizeError(
                "quantize: the calibration data is empty; pass at least one tuple of arguments"
            ) from None
        batches = itertools.chain([first], it)
    gptq = config.weight_calibration == "gptq"
    smooth = config.smoothing is not None
    needs_data = (config.activations is not None and not config.dynamic) or gptq or smooth
    if batches is None and (gptq or smooth):
        what = "weight_calibration='gptq' chooses weight codes" if gptq else "smoothing measures"
        raise QuantizeError(
            f"quantize: {what} from calibration data.\nPass calibration=[(x1,), (x2,), ...]."
        )
    if batches is None and needs_data:
        raise QuantizeError(
            "quantize: static activation scales need calibration data.\n"
            "Pass calibration=[(x1,), (x2,), ...], or use QConfig(dynamic=True) (scales at run "
            "time) or QConfig(activations=None) (weight-only)."
        )
    example = example_args if example_args is not None else first
    if example is None:
        raise QuantizeError("quantize: pass example_args (or calibration data) to trace f with")
    example = example if isinstance(example, tuple) else (example,)
    if wa and max(wa) >= len(example):
        raise ValueError(
            f"quantize: weight_argnums={wa} but the example arguments have {len(example)} positions"
        )
    fun = _bind_weights(f, wa, example) if wa else f

    def drop(args: Any) -> tuple[Any, ...]:
        args = args if isinstance(args, tuple) else (args,)
        return tuple(x for i, x in enumerate(args) if i not in wa) if wa else args

    def retrace(*args: Any) -> Program:
        return prepare(trace(fun, *args))

    try:
        program = trace(fun, *drop(example))
    except Exception as e:
        raise QuantizeError(
            f"quantize: could not trace f with the example arguments: {type(e).__name__}: {e}"
        ) from e
    program = annotate_program(program, config)
    if batches is not None and needs_data:
        program = calibrate_program(
            program, (drop(b) for b in batches), progress=progress, retrace=retrace
        )
    if mode == "realize":
        program = realize_program(program)
    return QuantizedFunction(fun, program, mode)
