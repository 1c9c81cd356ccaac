"""The quantization report: what was quantized, how, and how much error each layer adds."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxq._program import Program
from jaxq.quantize._annotate import unmatched_rules
from jaxq.quantize._qarray import QArray, is_qarray
from jaxq.quantize._state import QState, QuantizeError, QWeight, get_state


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """One row of :class:`Report`: one layer (a matmul or convolution) and how it was quantized.

    Attributes:
      name: the layer's equation name (``Dense_0/dot_general``).
      primitive: its primitive (``dot_general``, ``conv_general_dilated``).
      status: ``"quantized"``, or why the layer stays in float.
      weights: the weight scheme in short form (``int8 sym channel narrow``, plus the weight
        calibration when not min/max, and ``smoothed`` under SmoothQuant); None when in float.
      activations: the activation scheme in short form and whether its scale is ``static``
        (calibrated) or ``dynamic`` (computed at run time); None when activations stay float.
      weight_scale: ``(min, max)`` of the weight scales over channels (or groups).
      activation_scale: the calibrated activation scale (static activations only).
      activation_zero_point: the calibrated activation zero point (static activations only).
      rule: the index in ``QConfig.rules`` of the rule that chose this layer's schemes, or None
        for the QConfig's own.
      sqnr_db: SQNR (dB) of the layer's output against float on the report's ``sample``; None
        without one.
      clipped: the share of the sample's activation values outside the calibrated range; None
        without a sample.
      in_loop: the control-flow primitive whose body holds the layer (``"scan"``, ``"while"``
        or ``"cond"``, the innermost), or None at the top level (or inside ``jit`` / ``remat``
        calls). Such a layer runs many times per call: where the loop takes its weight param,
        its SQNR pools every run (a layer stack's: per layer, ``layer_sqnr_db``); with its
        weight closed over it has none. Its activation scale is calibrated over every run of
        the body on the data (a branch never taken gets scales computed at run time).
      layers: for a layer of a stack run by ``lax.scan`` (its weight a slice of a stacked
        param), the number of iterations, each quantized and calibrated with scales of its own;
        else 0.
      layer_sqnr_db: for such a layer with a sample, the SQNR of each iteration's output (in
        the stacked param's order); ``sqnr_db`` is then the worst of them.
      param: with params as an argument, the path of the layer's weight in them
        (``['Dense_0']['kernel']``, Equinox ``.blocks[1].fc2.weight``): what a ``Rule``'s
        pattern also matches, and a better name than a layer's equation name where the model's
        names say little (``vmap(eqx.nn.Conv)/conv_general_dilated_3``); else None.
      layer_activation_scale: for a layer of a stack with static activations, each
        iteration's calibrated activation scale (``activation_scale`` is then None).

    Later columns (e.g. SQNR) go after ``status``.
    """

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
    clipped: float | None = None  # share of the sample's activation values outside the range
    in_loop: str | None = None  # "scan" / "while" / "cond": the body the layer sits in
    layers: int = 0  # > 0: a layer of a scanned stack, with that many iterations
    layer_sqnr_db: tuple[float, ...] | None = None  # per iteration, for a layer of a stack
    param: str | None = None  # the weight's path in the params (params style)
    layer_activation_scale: tuple[float, ...] | None = None  # per iteration, for a stack's layer


@dataclasses.dataclass(frozen=True)
class Report:
    """What was quantized, and how. ``str(report)`` is a table; ``report.to_dict()`` the data.

    Attributes:
      mode: ``"realize"`` (integer code) or ``"simulate"`` (fake quantization).
      layers: a :class:`LayerReport` per layer, in program order (worst SQNR first when the
        report was made with a sample).
      unmatched_rules: the ``QConfig.rules`` that matched no layer (``rules[i]: Rule(...)``):
        usually a misspelt pattern.
      calibration: how activation scales were calibrated: ``method``, number of ``batches``,
        ``percentile``, and what GPTQ or smoothing did where used.
      param_bytes: bytes of the quantized parameters (codes and scales): the params' leaves
        where the function takes params, else the program's constants (closed-over weights).
      kv_caches: the loops (``lax.scan``) whose KV cache is carried as int8 codes with a scale
        per vector (``QConfig(kv_cache=True)``).
    """

    mode: str
    layers: tuple[LayerReport, ...]
    unmatched_rules: tuple[str, ...]
    calibration: dict[str, Any]
    param_bytes: int
    kv_caches: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (what :meth:`to_json` writes)."""
        return {
            "mode": self.mode,
            "layers": [dataclasses.asdict(r) for r in self.layers],
            "unmatched_rules": list(self.unmatched_rules),
            "calibration": dict(self.calibration),
            "param_bytes": self.param_bytes,
            "kv_caches": list(self.kv_caches),
        }

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """The report as JSON (infinite SQNR, for exact layers, is written as null)."""
        data = self.to_dict()
        for row in data["layers"]:
            if row["sqnr_db"] is not None and not math.isfinite(row["sqnr_db"]):
                row["sqnr_db"] = None
            if row["layer_sqnr_db"] is not None:
                row["layer_sqnr_db"] = [
                    v if math.isfinite(v) else None for v in row["layer_sqnr_db"]
                ]
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
        with_params = any(r.param is not None for r in self.layers)
        head = (
            "layer",
            *(("param",) if with_params else ()),
            "primitive",
            "weights",
            "activations",
            "w scale",
            "a scale",
            "SQNR dB",
            "clipped %",
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
            if r.layer_activation_scale:  # (a stack's layer: the range over its iterations)
                a_s = f"{min(r.layer_activation_scale):.3g}..{max(r.layer_activation_scale):.3g}"
            sq = "" if r.sqnr_db is None else f"{r.sqnr_db:.1f}"
            if r.layer_sqnr_db:  # (a stack's layer: the range over its iterations)
                sq = f"{min(r.layer_sqnr_db):.1f}..{max(r.layer_sqnr_db):.1f}"
            cl = "" if r.clipped is None else f"{100 * r.clipped:.2f}"
            status = r.status
            if r.in_loop is not None and "inside" not in status:
                status += f" (inside a {r.in_loop} body)"
            rows.append(
                (
                    r.name,
                    *((r.param or "",) if with_params else ()),
                    r.primitive,
                    r.weights or "float",
                    r.activations or "float",
                    ws,
                    a_s,
                    sq,
                    cl,
                    status,
                )
            )
        widths = [
            max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
            for i, h in enumerate(head)
        ]
        widths[-1] = len(head[-1])  # (a long status runs on: the other rows are not padded to it)
        fmt = "  ".join(f"{{:{w}}}" for w in widths)
        lines = [f"jaxq.quantize report (mode={self.mode}, parameter bytes={self.param_bytes})"]
        lines.append(fmt.format(*head))
        lines.append(fmt.format(*("-" * w for w in widths)))
        lines += [fmt.format(*row).rstrip() for row in rows]
        if self.calibration:
            lines.append(f"calibration: {self.calibration}")
        if self.kv_caches:
            lines.append(f"KV cache int8 (a scale per vector) in: {', '.join(self.kv_caches)}")
        if self.unmatched_rules:
            lines.append("rules that matched nothing:")
            lines += [f"  {u}" for u in self.unmatched_rules]
        return "\n".join(lines)


def _clipped_of(clipped: dict[str, float] | None, name: str) -> float | None:
    """A layer's clipped share (inside a layer stack: the mean over its iterations)."""
    if clipped is None:
        return None
    values = [v for k, v in clipped.items() if k.split("@")[0] == name]
    return float(np.mean(values)) if values else None


def _float_param(state: Any, name: str) -> str | None:
    """The path of the one param a layer left float reads as its weight, if it reads one."""
    leaves = state.float_reads.get(name, ())
    return state.params.paths[leaves[0]] if len(leaves) == 1 and state.params else None


def param_bytes(program: Program, params: Any = None) -> int:
    """Bytes of ``params`` (QArrays count what they store); without params, of the program's
    constants (the closed-over weights). With params, the program's constants are no parameters:
    a KV cache's zeros, a mask, a table of rotary angles."""
    if params is not None:
        return int(sum(_nbytes(x) for x in jax.tree.leaves(params, is_leaf=is_qarray)))
    return int(sum(_nbytes(c) for c in program.jaxpr.consts if hasattr(c, "shape")))


def _nbytes(x: Any) -> int:
    """What ``x`` stores: arrays (typed PRNG keys too, which numpy cannot convert), QArrays, and
    Python scalars as numpy stores them."""
    return int(x.nbytes) if hasattr(x, "nbytes") else np.asarray(x).nbytes


def sqnr_db(reference: Any, approx: Any) -> float:
    """``10 log10(sum(ref^2) / sum((ref - approx)^2))`` in dB; infinite when they are equal,
    NaN when there are no values (an empty batch measures nothing)."""
    ref = np.asarray(reference, np.float64)
    if ref.size == 0:
        return math.nan
    noise = float(np.sum((ref - np.asarray(approx, np.float64)) ** 2))
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(float(np.sum(ref**2)), 1e-300) / noise)


LOOPS = ("scan", "while", "cond")
"""Control-flow primitives whose bodies run many times (or not at all) per call."""


def enclosing_loops(program: Program) -> dict[str, str]:
    """``{equation name: innermost scan / while / cond holding it}`` for nested equations."""
    primitive = {e.path: e.primitive for e in program.equations()}
    out = {}
    for e in program.equations():
        # ancestors: the prefixes that end at an equation index (path = i, label, j, label, ...)
        for k in range(len(e.path) - 2, 0, -2):
            prim = primitive.get(e.path[:k])
            if prim in LOOPS:
                out[e.name] = prim
                break
    return out


def check_mask(mask: Any, who: str) -> np.ndarray:
    """``mask`` as a bool numpy array (True: a valid position), or an error saying what it takes."""
    m = np.asarray(jax.device_get(mask))
    if m.dtype != np.bool_ and not np.issubdtype(m.dtype, np.integer):
        raise TypeError(
            f"{who}: mask must be a bool array, True where a position is valid (e.g. "
            f"[batch, tokens] for padded tokens); got dtype {m.dtype}"
        )
    if m.ndim == 0:
        raise ValueError(
            f"{who}: mask must have at least one axis (e.g. [batch, tokens]); got a scalar"
        )
    m = m != 0
    if not m.any():
        raise ValueError(f"{who}: mask marks no valid position (it is False everywhere)")
    return m


def fit_mask(
    mask: Any,
    shape: tuple[int, ...],
    layer: str,
    what: str,
    who: str,
    loops: tuple[tuple[int, Any, bool], ...] = (),
) -> Any:
    """``mask`` (numpy or traced) made to broadcast against a tensor of ``shape``: its axes
    against the tensor's leading axes (each equal, or 1 in the mask); or, where the tensor holds
    every masked position flattened in its first axis (``[batch * tokens, features]``), one
    leading axis in row-major order; or, inside ``loops`` (``Engine.loops``: length, index and
    whether a layer stack, of each enclosing scan), for a tensor of one step (``[batch,
    features]`` in a loop over time), the mask at that step along the one axis the tensor lacks
    as long as the loop; or, for a tensor that lost the mask's last axes (a pooled ``[batch,
    features]`` output), the mask reduced over them: a row is valid where any of its positions
    is. Else an error naming the layer."""
    k, n = mask.ndim, len(shape)
    fits = lambda j: all(m in (1, s) for m, s in zip(mask.shape[:j], shape[:j], strict=False))
    if k <= n and fits(k):
        return mask.reshape(*mask.shape, *(1,) * (n - k))
    size = math.prod(mask.shape)
    if n >= 1 and shape[0] == size:
        return mask.reshape(size, *(1,) * (n - 1))
    for depth in reversed(range(len(loops))):  # (the innermost loop first)
        length, index, stack = loops[depth]
        lacked = [j for j in range(max(n - 1, 0), k) if mask.shape[j] == length]
        if not stack and len(lacked) == 1:
            step = jnp.take(mask, index, axis=lacked[0])
            return fit_mask(step, shape, layer, what, who, loops[:depth])
    if 2 <= n <= k and fits(n - 1):  # (the features last: every axis but one is the mask's)
        return mask.any(axis=tuple(range(n - 1, k))).reshape(*mask.shape[: n - 1], 1)
    raise QuantizeError(
        f"{who}: the mask of shape {tuple(mask.shape)} cannot be broadcast against the {what} of "
        f"layer {layer!r}, of shape {tuple(shape)}.\n"
        "The mask's axes must match the leading axes of every measured layer's output and "
        "activation (each equal, or 1 in the mask), or the first axis must hold all its "
        f"{size} positions flattened ([batch * tokens, ...]). Pass a mask shaped like the "
        "leading axes of this layer's tensors, or skip the layer with a Rule."
    )


def masked(values: np.ndarray, mask: np.ndarray | None, layer: str, what: str, who: str) -> Any:
    """The elements of ``values`` at valid positions (all of them without a mask)."""
    if mask is None:
        return values
    values = np.asarray(values)
    return values[np.broadcast_to(fit_mask(mask, values.shape, layer, what, who), values.shape)]


def _worst_first(rows: list[LayerReport]) -> list[LayerReport]:
    measured = sorted(
        (r for r in rows if r.sqnr_db is not None), key=lambda r: float(r.sqnr_db or 0)
    )
    return measured + [r for r in rows if r.sqnr_db is None]


def make_report(
    program: Program,
    sqnr: dict[str, float] | None = None,
    qparams: Any = None,
    clipped: dict[str, float] | None = None,
) -> Report:
    """The report of a quantized program; ``qparams``: its quantized params (params style)."""
    state = get_state(program, "report")
    by_site: dict[str, Any] = {}
    if qparams is not None and state.params is not None:
        leaves = jax.tree.leaves(qparams, is_leaf=is_qarray)
        sites = {plan.site: i for i, plan in state.leaves.items()}
        sites.update(state.site_leaves)  # (every site of a shared leaf)
        by_site = {name: leaves[i] for name, i in sites.items() if isinstance(leaves[i], QArray)}
    loops = enclosing_loops(state.source)
    paths: dict[str, str] = {}
    if state.params is not None:
        leaf_of = {plan.site: i for i, plan in state.leaves.items()}
        leaf_of.update(state.site_leaves)
        paths = {name: state.params.paths[i] for name, i in leaf_of.items()}
    rows = []
    for e in state.source.equations():
        site = state.sites.get(e.name)
        if e.name in state.act_act:
            rows.append(
                LayerReport(
                    e.name,
                    e.primitive,
                    "quantized",
                    "none (activation x activation)",
                    f"{state.act_act[e.name].short()} dynamic (both operands)",
                    sqnr_db=None if sqnr is None else sqnr.get(e.name),
                    in_loop=loops.get(e.name),
                )
            )
            continue
        if site is None:
            if e.name in state.skipped:
                why = state.skipped[e.name]
                by = re.match(r"skipped by rules\[(\d+)\]", why)
                rows.append(
                    LayerReport(
                        e.name,
                        e.primitive,
                        why,
                        rule=None if by is None else int(by.group(1)),
                        in_loop=loops.get(e.name),
                        param=_float_param(state, e.name),
                    )
                )
            continue
        qw = state.weights.get(e.name)
        wscale = None
        if qw is not None:
            src = qw.group_scale if qw.group_scale is not None else qw.scale
            wscale = (float(np.min(src)), float(np.max(src)))
        elif e.name in by_site:
            src = np.asarray(by_site[e.name].scale)
            wscale = (float(np.min(src)), float(np.max(src)))
        acts = None
        a_scale = a_zp = layer_scales = None
        status = "quantized"
        per_layer = None
        if sqnr is not None and site.layers:
            keys = site.act_keys()
            per_layer = tuple(sqnr[k] for k in keys) if all(k in sqnr for k in keys) else None
        if site.activations is not None:
            params = state.act.get(e.name)
            if site.layers and all(k in state.act for k in site.act_keys()):
                kind = f"static ({site.layers} layers)"
                layer_scales = tuple(float(state.act[k].scale) for k in site.act_keys())
            elif params is not None:
                kind = "static"
                a_scale, a_zp = params.scale, params.zero_point
            elif state.config.dynamic or site.activations.granularity == "token":
                kind = "dynamic"
            else:
                kind = "dynamic (inside a loop)" if site.in_loop else "dynamic (not calibrated)"
            acts = f"{site.activations.short()} {kind}"
        rows.append(
            LayerReport(
                e.name,
                e.primitive,
                status,
                site.weights.short() + _method(state, e.name, qw) + (_smoothed(state, e.name)),
                acts,
                wscale,
                a_scale,
                a_zp,
                site.rule,
                min(per_layer) if per_layer else None if sqnr is None else sqnr.get(e.name),
                _clipped_of(clipped, e.name),
                loops.get(e.name),
                site.layers,
                per_layer,
                paths.get(e.name),
                layer_scales,
            )
        )
    return Report(
        mode=state.mode,
        layers=tuple(rows if sqnr is None else _worst_first(rows)),
        unmatched_rules=tuple(unmatched_rules(state.config, state.matched_rules, state.source)),
        calibration=dict(state.calibration),
        param_bytes=param_bytes(program, qparams),
        kv_caches=state.kv_caches,
    )


def _method(state: QState, name: str, qw: QWeight | None) -> str:
    """`` mse`` or `` gptq`` where a layer's weight codes were not chosen by min/max: as its
    constant weight records, or for a param leaf (quantized by quantize_params) as the config
    asks where calibration measured what the method needs."""
    if qw is not None:
        return "" if qw.method == "minmax" else f" {qw.method}"
    method = state.config.weight_calibration
    if method == "gptq" and name not in state.grams and f"{name}@0" not in state.grams:
        return ""  # (a layer GPTQ does not apply to: min/max)
    if method == "gptq" and state.mode == "simulate" and state.params is not None:
        return " gptq (at realize; simulate rounds)"
    return f" {method}" if method in ("mse", "gptq") else ""


def _smoothed(state: QState, name: str) -> str:
    """`` smoothed`` (SmoothQuant) or `` awq`` where a layer's input channels are scaled."""
    if name not in state.smooth and f"{name}@0" not in state.smooth:
        return ""
    return " awq" if state.config.weight_calibration == "awq" else " smoothed"
