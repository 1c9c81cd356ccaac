"""The shared machinery of annotate / calibrate / realize.

Every phase rewrites the *float* program kept in the quantization state (``program.meta["quantize"]``)
through one table of rules, with one rule per quantizable primitive whose behaviour depends on the
mode: ``"simulate"`` (fake-quantize with ``simulated_quantize``), ``"observe"`` (record statistics for
calibration) or ``"realize"`` (integer code). Sites, calibrated scales and quantized weights are keyed
by equation name, so a re-trace at new shapes finds them again.

A weight is either a param leaf (``jaxq.quantize(f, params)``: an input of the program, tracked
through layout-only equations as a ``WeightRef``, see ``_params``) or an operand whose value is
known while rewriting: a constant of the jaxpr (arrays the function closes over), or one derived
from constants only through pass-through ops (transpose, reshape, convert...), which are folded
here. Calls to ``jit`` are inlined so that weights flow into their bodies.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxq import _compat as C
from jaxq._program import Program
from jaxq._program import _path_str as path_str
from jaxq._walk import RewriteError, Visit, retrace, rewrite
from jaxq.annotate._simulated_quantize import _ROUND, simulated_quantize_p
from jaxq.quantize._config import INHERIT, QConfig, Scheme
from jaxq.quantize._gptq import gptq_codes
from jaxq.quantize._params import (
    CHAIN,
    LeafPlan,
    QView,
    WeightRef,
    chain_value,
    float_leaf,
    leaf_axis,
    to_float,
)
from jaxq.quantize._qarray import QArray, is_qarray

if TYPE_CHECKING:
    from jax.core import ShapedArray

QUANTIZABLE = ("dot_general", "conv_general_dilated")
ELEMENTWISE = ("add", "mul")
"""Quantized only where a Rule names them in ``primitives`` (a bias or a scale): weights only."""
FOLDABLE = (
    "transpose",
    "reshape",
    "convert_element_type",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
    "slice",
    "rev",
    "concatenate",
    "reduce_precision",
)
INLINE = ("jit", "pjit", "closed_call", "core_call")
META_KEY = "quantize"


QParam: TypeAlias = "jax.Array | np.float32"
"""A scale or zero point: traced (dynamic) or a host float32 scalar (calibrated, folded in numpy)."""


def shaped_aval(atom: Any) -> ShapedArray:
    """``atom.aval`` as a ShapedArray: quantized operands are arrays, but JAX types ``Var.aval`` as
    the base ``AbstractValue``, which has no shape or dtype."""
    return cast("ShapedArray", atom.aval)


class QuantizeError(ValueError):
    """A quantization phase cannot proceed; the message names the layer."""


# ---- data kept in Program.meta -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Site:
    """One quantized equation."""

    name: str
    primitive: str
    weight_index: int
    weights: Scheme
    activations: Scheme | None
    rule: int | None
    channel_axis: int  # weight axis with one scale per channel
    contract_axes: tuple[int, ...]  # weight axes contracted away
    reduce_axes: tuple[int, ...]  # activation axes reduced per token
    in_loop: bool = False  # inside scan / while / cond: not reachable by calibration


@dataclasses.dataclass(frozen=True, eq=False)
class QWeight:
    """A weight quantized once: signed codes (offset into the signed range of ``bits``) and the
    scale / zero point broadcastable against the weight (zero point in code units, offset too).
    Host numpy arrays for a constant weight; traced arrays for a param (``view_qweight``)."""

    codes: Any  # int8, the weight's shape
    scale: Any  # float32, broadcastable to the weight (full size for groups)
    zero_point: Any  # int32, broadcastable like scale
    offset: int  # codes = unsigned codes + offset (0 for signed schemes)
    bits: int
    group_scale: Any = None  # [channels, groups] for granularity="group"
    group_zero_point: Any = None
    method: str = "minmax"  # how the codes were chosen: "minmax", "mse" or "gptq"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape


@dataclasses.dataclass(frozen=True)
class ActParams:
    scale: float
    zero_point: int  # in the scheme's own code range (not offset)


@dataclasses.dataclass(frozen=True, eq=False)
class QState:
    """Everything the quantization passes share, stored as ``program.meta["quantize"]``."""

    config: QConfig
    source: Program  # the float program (named, with layouts)
    sites: Mapping[str, Site]
    skipped: Mapping[str, str]  # equation name -> why it stays float
    weights: Mapping[str, QWeight]
    act: Mapping[str, ActParams] = dataclasses.field(default_factory=dict)
    matched_rules: frozenset[int] = frozenset()
    calibration: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mode: str = "simulate"
    act_absmax: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """Per-input-channel ``max |X|`` of smoothed layers (``QConfig.smoothing``)."""
    smooth: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """SmoothQuant factors ``s`` per layer (the activation is divided by them, the weight times)."""
    params: ParamSpec | None = None
    """Which program inputs are the params (``jaxq.quantize(f, params)``), else None."""
    leaves: Mapping[int, LeafPlan] = dataclasses.field(default_factory=dict)
    """Quantized param leaves by flat index: the layer each feeds, and how."""
    grams: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """GPTQ's ``X^T X`` per layer (params style: the codes are chosen by ``quantize_params``)."""
    output: Any = None
    """The jaxpr the last phase produced: a later phase given another program re-reads it."""

    def replace(self, **changes: Any) -> QState:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """The params argument of the traced function: ``args[argnum]``, flat inputs
    ``[start, start + len(paths))`` of the program."""

    argnum: int
    start: int
    paths: tuple[str, ...]
    avals: tuple[Any, ...]
    tree: Any

    @property
    def count(self) -> int:
        return len(self.paths)


def param_spec(program: Program, argnum: int) -> ParamSpec:
    """Locate ``args[argnum]`` among the program's flat inputs."""
    n = len(program.jaxpr.in_avals)
    args, _ = jax.tree.unflatten(program.in_tree, list(range(n)))
    if not 0 <= argnum < len(args):
        raise QuantizeError(
            f"quantize: params are argument {argnum}, but the function takes {len(args)} "
            "positional arguments"
        )
    idx, tree = jax.tree.flatten(args[argnum])
    start = idx[0] if idx else 0
    paths = tuple(
        program.in_paths[i].removeprefix(f"args[{argnum}]") or f"args[{argnum}]" for i in idx
    )
    avals = tuple(program.jaxpr.in_avals[i] for i in idx)
    return ParamSpec(argnum, start, paths, avals, tree)


def get_state(program: Program, who: str) -> QState:
    state = program.meta.get(META_KEY) if program.meta else None
    if not isinstance(state, QState):
        raise QuantizeError(
            f"{who}: the program carries no quantization state.\n"
            "Run jaxq.quantize.annotate(config) on it first, e.g.\n"
            "  program = jaxq.quantize.annotate(QConfig())(jaxq.trace(f, x))"
        )
    return state


def with_state(program: Program, state: QState) -> Program:
    meta = dict(program.meta or {})
    meta[META_KEY] = state
    return program.replace(meta=types.MappingProxyType(meta))


# ---- rules: which scheme applies where ------------------------------------------------------------


def resolve(
    config: QConfig, name: str, primitive: str
) -> tuple[Scheme | None, Scheme | None, int | None]:
    """``(weights, activations, rule index)`` for an equation; weights None means float."""
    if primitive in ELEMENTWISE:  # opt-in: a rule must name the primitive; weights only
        for i, rule in enumerate(config.rules):
            if rule.primitives and primitive in rule.primitives and rule.matches(name, primitive):
                w = (
                    None
                    if rule.skip
                    else config.weights
                    if rule.weights is INHERIT
                    else rule.weights
                )
                return w, None, i
        return None, None, None
    for i, rule in enumerate(config.rules):
        if rule.matches(name, primitive):
            if rule.skip:
                return None, None, i
            w = config.weights if rule.weights is INHERIT else rule.weights
            a = config.activations if rule.activations is INHERIT else rule.activations
            return w, a, i
    return config.weights, config.activations, None


# ---- scales -------------------------------------------------------------------------------------


def range_to_qparams(lo: Any, hi: Any, scheme: Scheme) -> tuple[jax.Array, jax.Array]:
    """Scale and zero point (float32, scheme's code range) covering ``[lo, hi]`` (and 0)."""
    qmin, qmax = scheme.qrange
    lo = jnp.minimum(jnp.asarray(lo, jnp.float32), 0.0)
    hi = jnp.maximum(jnp.asarray(hi, jnp.float32), 0.0)
    if scheme.symmetric:
        if scheme.signed:
            scale = jnp.maximum(-lo, hi) / jnp.float32(2 ** (scheme.bits - 1) - 1)
        else:
            scale = hi / jnp.float32(qmax)
    else:
        scale = (hi - lo) / jnp.float32(qmax - qmin)
    scale = jnp.where((scale > 0) & jnp.isfinite(scale), scale, jnp.float32(1.0))
    if scheme.symmetric:
        zp = jnp.zeros_like(scale)
    else:
        zp = jnp.clip(jnp.round(qmin - lo / scale), qmin, qmax)
    return scale, zp


def codes(x: jax.Array, scale: QParam, zp: QParam, scheme: Scheme) -> jax.Array:
    """Integer codes, as float32, computed exactly as ``simulated_quantize`` computes them."""
    qmin, qmax = scheme.qrange
    return jnp.clip(_ROUND[scheme.rounding](x.astype(scale.dtype) / scale) + zp, qmin, qmax)


INT8_VIA_INT32_MIN = 2**16
"""Tensors at least this large reach int8 through int32 (see ``int8_codes``)."""


def int8_codes(q: jax.Array) -> jax.Array:
    """Float codes (integers in the int8 range) as int8. A large tensor converts through int32:
    XLA:CPU's YNN fusion would otherwise pull a direct f32 -> s8 convert into the next kernel,
    and the loop fusion before it would write the codes as f32 (4x the bytes; measured 20-25%
    faster for a requantize feeding a pooled int8 matmul at batch 256). A small one converts
    directly: there the convert inside the kernel is cheaper (measured at batch 1)."""
    if q.size >= INT8_VIA_INT32_MIN:
        q = q.astype(jnp.int32)
    return q.astype(jnp.int8)


def storage_offset(scheme: Scheme) -> int:
    """Shift that moves unsigned codes into the signed range (u8 never takes XLA's fast path)."""
    return 0 if scheme.signed else -(2 ** (scheme.bits - 1))


# ---- weights ----------------------------------------------------------------------------------


MSE_RATIOS = tuple(1.0 - 0.02 * i for i in range(26))
"""Clipping ratios of a weight's range tried by ``weight_calibration="mse"`` (1.0 down to 0.5)."""


def _weight_ranges(
    wf: jax.Array, axes: tuple[int, ...], s: Scheme, method: str
) -> tuple[jax.Array, jax.Array]:
    """``(lo, hi)`` of each block (``axes`` reduced, keepdims), clipped to the ratio with the
    least squared error when ``method="mse"``."""
    lo, hi = jnp.min(wf, axes, keepdims=True), jnp.max(wf, axes, keepdims=True)
    if method != "mse":
        return lo, hi
    qmin, qmax = s.qrange

    def error(r: float) -> jax.Array:
        scale, zp = range_to_qparams(lo * r, hi * r, s)
        q = jnp.clip(jnp.round(wf / scale) + zp, qmin, qmax)
        return jnp.sum(jnp.square((q - zp) * scale - wf), axes, keepdims=True)

    best_err, best_r = error(1.0), jnp.ones_like(lo)
    for r in MSE_RATIOS[1:]:
        err = error(r)
        best_r = jnp.where(err < best_err, r, best_r)
        best_err = jnp.minimum(err, best_err)
    return lo * best_r, hi * best_r


def weight_qparams(wf: jax.Array, site: Site, method: str) -> tuple[Any, Any, Any, Any]:
    """``(scale, zero_point, group_scale, group_zero_point)`` of a float32 weight in the site's
    orientation: scale and zero point broadcastable to it (full size for groups), the group ones
    ``[channels, groups]`` (None unless grouped). Core ops only, so the same arithmetic runs on
    the host (``quantize_weight``) and inside a program (QAT on params)."""
    s = site.weights
    if s.granularity in ("tensor", "channel"):
        wc = jnp.moveaxis(wf, site.channel_axis, -1).reshape(-1, wf.shape[site.channel_axis])
        axes = (0, 1) if s.granularity == "tensor" else (0,)
        lo, hi = _weight_ranges(wc, axes, s, method)
        scale, zp = range_to_qparams(lo, hi, s)
        if s.granularity == "channel":  # [1, N] -> broadcastable to the weight
            shape = [1] * wf.ndim
            shape[site.channel_axis] = -1
            return scale.reshape(shape), zp.reshape(shape), None, None
        return scale.reshape(()), zp.reshape(()), None, None
    # group: a 2-D weight, groups along the contracted axis, per channel
    wt = jnp.moveaxis(wf, site.channel_axis, 0)  # [N, K]
    n, kk = wt.shape
    g = s.group_size
    assert g is not None  # Scheme requires group_size with granularity="group"
    lo, hi = _weight_ranges(wt.reshape(n, kk // g, g), (2,), s, method)
    group_scale, group_zp = range_to_qparams(lo[..., 0], hi[..., 0], s)
    full_scale = jnp.moveaxis(jnp.repeat(group_scale, g, axis=1), 0, site.channel_axis)
    full_zp = jnp.moveaxis(jnp.repeat(group_zp, g, axis=1), 0, site.channel_axis)
    return full_scale, full_zp, group_scale, group_zp


def traced_qweight(w: jax.Array, site: Site, method: str) -> QWeight:
    """A weight's scales computed inside the program from its current value (params in simulate
    mode: QAT moves the weights, and the scales follow). No codes: the simulated program
    fake-quantizes the weight itself. ``"gptq"`` needs data, so it uses minmax scales here."""
    wf = lax.stop_gradient(w.astype(jnp.float32))
    scale, zp, gs, gz = weight_qparams(wf, site, "mse" if method == "mse" else "minmax")
    off = storage_offset(site.weights)
    return QWeight(
        codes=None,  # (not materialized in simulate mode)
        scale=scale,
        zero_point=(zp + off).astype(jnp.int32),
        offset=off,
        bits=site.weights.bits,
        group_scale=gs,
        group_zero_point=None if gz is None else (gz + off).astype(jnp.int32),
        method=method,
    )


def view_qweight(view: QView, site: Site) -> QWeight:
    """A QArray's values (traced, in the site's orientation) as the QWeight realize lowers;
    a symmetric weight's zero point is a host zero, so no zero-point term is emitted."""
    s = site.weights
    scale = view.scale
    symmetric = view.zero_point is None
    zp = np.zeros((), np.int32) if symmetric else view.zero_point
    gs = gz = None
    if s.granularity == "group":
        c = site.channel_axis
        n = view.codes.shape[c]
        gs = jnp.moveaxis(scale, c, 0).reshape(n, -1)
        gz = np.zeros(gs.shape, np.int32) if symmetric else jnp.moveaxis(zp, c, 0).reshape(n, -1)
        scale = view.full(scale)
        zp = zp if symmetric else view.full(zp)
    return QWeight(
        codes=view.codes,
        scale=scale,
        zero_point=zp,
        offset=storage_offset(s),
        bits=s.bits,
        group_scale=gs,
        group_zero_point=gz,
        method="params",
    )


def quantize_weight(
    w: Any,
    site: Site,
    method: str = "minmax",
    gram: np.ndarray | None = None,
    damp: float = 0.1,
) -> QWeight:
    """Quantize a weight once, with ``simulated_quantize``'s arithmetic (eagerly). ``method``:
    how scales and codes are chosen (``QConfig.weight_calibration``); ``"gptq"`` needs ``gram``,
    the second moment of the activation over the weight's contracted axes flattened in order
    (else minmax)."""
    s = site.weights
    with jax.ensure_compile_time_eval():
        wf = jnp.asarray(w, jnp.float32)
        if not bool(jnp.all(jnp.isfinite(wf))):
            raise QuantizeError(f"quantize: weight of {site.name!r} holds NaN or Inf")
        full_scale, full_zp, group_scale, group_zp = weight_qparams(wf, site, method)
        off = storage_offset(s)
        scales = QWeight(
            codes=np.zeros(wf.shape, np.int8),
            scale=np.asarray(full_scale, np.float32),
            zero_point=np.asarray(full_zp + off).astype(np.int32),
            offset=off,
            bits=s.bits,
            group_scale=None if group_scale is None else np.asarray(group_scale, np.float32),
            group_zero_point=None if group_zp is None else np.asarray(group_zp + off, np.int32),
            method="mse" if method == "mse" else "minmax",
        )
        if method == "gptq" and gram is not None:
            # rows: the contracted axes flattened in order (the order of ``gram``)
            perm = [
                *site.contract_axes,
                *(d for d in range(wf.ndim) if d not in site.contract_axes),
            ]
            k = math.prod(wf.shape[d] for d in site.contract_axes)
            to_2d = lambda v: np.transpose(
                np.broadcast_to(np.asarray(v, np.float64), wf.shape), perm
            ).reshape(k, -1)
            q = gptq_codes(to_2d(wf), to_2d(scales.scale), to_2d(full_zp), s.qrange, gram, damp)
            q = np.transpose(q.reshape([wf.shape[d] for d in perm]), np.argsort(perm))
            return dataclasses.replace(scales, codes=(q + off).astype(np.int8), method="gptq")
        # The codes are read back from the simulated value itself: XLA divides by a broadcast
        # scale as w * (1 / s), so recomputing round(w / s) elsewhere (in numpy) could differ by
        # one code at a tie.
        fq = np.asarray(fake_quant_weight(np.asarray(wf), scales, site), np.float64)
        q = np.rint(fq / scales.scale) + (scales.zero_point - off)
    return dataclasses.replace(scales, codes=(q + off).astype(np.int8))


def dequantized_weight(qw: QWeight, dtype: Any) -> np.ndarray:
    """``(codes - zero_point) * scale`` in float32, as ``simulated_quantize`` computes it: for
    codes not chosen by rounding (GPTQ), the float weight the simulated program uses instead."""
    w = (qw.codes.astype(np.float32) - qw.zero_point.astype(np.float32)) * qw.scale
    return w.astype(dtype)


def _sq_params(scheme: Scheme, kind: str) -> dict[str, Any]:
    """The static params of ``simulated_quantize_p`` for a scheme (axis and groups aside)."""
    return dict(
        bits=scheme.bits,
        signed=scheme.signed,
        kind=kind,
        rounding=scheme.rounding,
        narrow_range=scheme.narrow_range,
        ste="identity",
    )


def fake_quant_weight(w: Any, qw: QWeight, site: Site) -> jax.Array:
    """``simulated_quantize(w, kind="weight")`` with the weight's precomputed scales."""
    s = site.weights
    params = _sq_params(s, "weight")
    # A known weight stays a numpy array, so the simulated value is computed the same way (numpy
    # arithmetic) when the program runs eagerly and when realize reads the codes back.
    xp = np if is_concrete(w) else jnp
    w = np.asarray(w) if is_concrete(w) else w
    zp = (qw.zero_point - qw.offset).astype(np.float32)
    if s.granularity == "tensor":
        return simulated_quantize_p.bind(
            w, qw.scale.reshape(()), zp.reshape(()), axis=None, group_size=None, **params
        )
    if s.granularity == "channel":
        c = site.channel_axis
        return simulated_quantize_p.bind(
            w, qw.scale.reshape(-1), zp.reshape(-1), axis=c, group_size=None, **params
        )
    # group: channel axis moved to the front, so the [N, G] scale's leading dim lines up with it
    wt = xp.moveaxis(w, site.channel_axis, 0)
    assert qw.group_zero_point is not None  # quantize_weight sets it for granularity="group"
    gzp = (qw.group_zero_point - qw.offset).astype(np.float32)
    y = simulated_quantize_p.bind(
        wt, qw.group_scale, gzp, axis=1, group_size=s.group_size, **params
    )
    return jnp.moveaxis(y, 0, site.channel_axis)


# ---- activations --------------------------------------------------------------------------------


def act_qparams(
    x: jax.Array, scheme: Scheme, site: Site, params: ActParams | None
) -> tuple[QParam, QParam]:
    """Static (calibrated) scale and zero point, or dynamic ones computed from ``x`` (per tensor,
    or per token with keepdims over the site's reduce axes)."""
    if params is not None:  # host constants: scale arithmetic folds in numpy
        return np.float32(params.scale), np.float32(params.zero_point)
    xf = lax.stop_gradient(x.astype(jnp.float32))
    ax = site.reduce_axes if scheme.granularity == "token" else None
    keep = scheme.granularity == "token"
    if scheme.symmetric:  # one reduction: the scale only needs max|x| (signed) or max(x)
        hi = jnp.max(jnp.abs(xf) if scheme.signed else xf, ax, keepdims=keep)
        return range_to_qparams(-hi if scheme.signed else jnp.zeros_like(hi), hi, scheme)
    return range_to_qparams(jnp.min(xf, ax, keepdims=keep), jnp.max(xf, ax, keepdims=keep), scheme)


def fake_quant_act(
    x: jax.Array, scale: QParam, zp: QParam, scheme: Scheme, site: Site
) -> jax.Array:
    params = dict(_sq_params(scheme, "activation"), group_size=None)
    if np.ndim(scale) == 0:
        return simulated_quantize_p.bind(
            x, jnp.asarray(scale), jnp.asarray(zp), axis=None, **params
        )
    # per token: kept axes first, so the scale's leading dims line up with x's
    kept = tuple(d for d in range(x.ndim) if d not in site.reduce_axes)
    perm = kept + tuple(site.reduce_axes)
    xt = jnp.transpose(x, perm)
    shape = tuple(x.shape[d] for d in kept)
    y = simulated_quantize_p.bind(xt, scale.reshape(shape), zp.reshape(shape), axis=None, **params)
    return jnp.transpose(y, tuple(int(d) for d in np.argsort(perm)))


# ---- geometry -----------------------------------------------------------------------------------


def _dot_geometry(visit: Visit, wi: int) -> tuple[int, tuple[int, ...], tuple[int, ...]] | str:
    (lc, rc), (lb, rb) = visit.params["dimension_numbers"]
    shapes = [shaped_aval(v).shape for v in visit.eqn.invars]
    wc, wb = (lc, rc)[wi], (lb, rb)[wi]
    ac = (lc, rc)[1 - wi]
    free = [d for d in range(len(shapes[wi])) if d not in wc and d not in wb]
    if not free:
        return "the weight has no output-channel axis"
    lay = visit.in_layouts[wi] if visit.in_layouts else None
    letter = "O" if wi == 1 else "N"
    channel = lay.index(letter) if lay and letter in lay else free[0]
    return channel, tuple(wc), tuple(ac)


def _conv_geometry(visit: Visit, wi: int) -> tuple[int, tuple[int, ...], tuple[int, ...]] | str:
    if wi != 1:
        return "the convolution's input (not its kernel) is constant"
    p = visit.params
    if p["batch_group_count"] != 1:
        return "batch_group_count > 1"
    dn = p["dimension_numbers"]
    lay = visit.in_layouts[1] if visit.in_layouts else None
    channel = lay.index("O") if lay and "O" in lay else dn.rhs_spec[0]
    nd = len(dn.rhs_spec)
    lhs_nd = len(dn.lhs_spec)
    contract = tuple(d for d in range(nd) if d != channel)
    reduce = tuple(d for d in range(lhs_nd) if d != dn.lhs_spec[0])
    return channel, contract, reduce


def _elementwise_geometry(
    visit: Visit, wi: int, weights: Scheme
) -> tuple[int, tuple[int, ...], tuple[int, ...]] | str:
    shape = shaped_aval(visit.eqn.invars[wi]).shape
    if weights.granularity == "group":
        raise QuantizeError(
            f"quantize: granularity='group' applies to matmul weights; {visit.name!r} is a "
            f"{visit.primitive}. Use 'tensor' or 'channel' in its Rule."
        )
    if not shape and weights.granularity == "channel":
        return "a scalar operand has no channel axis"
    return max(len(shape) - 1, 0), (), ()


def gptq_input_axis(visit: Visit, site: Site) -> int | None:
    """The activation axis whose second moment GPTQ needs, or None where it does not apply
    (convolutions, batched matmuls, several contracted axes)."""
    if site.primitive != "dot_general" or len(site.contract_axes) != 1:
        return None
    (lc, rc), (lb, rb) = visit.params["dimension_numbers"]
    if lb or rb:
        return None
    return (lc, rc)[1 - site.weight_index][0]


def make_site(
    visit: Visit,
    config: QConfig,
    wi: int,
    weights: Scheme,
    acts: Scheme | None,
    rule: int | None,
    in_loop: bool,
) -> Site | str:
    if visit.primitive in ELEMENTWISE:
        geo = _elementwise_geometry(visit, wi, weights)
    elif visit.primitive == "dot_general":
        geo = _dot_geometry(visit, wi)
    else:
        geo = _conv_geometry(visit, wi)
    if isinstance(geo, str):
        return geo
    channel, contract, reduce = geo
    w_aval = shaped_aval(visit.eqn.invars[wi])
    if weights.granularity == "group":
        if visit.primitive != "dot_general" or len(w_aval.shape) != 2 or len(contract) != 1:
            raise QuantizeError(
                f"quantize: granularity='group' needs a 2-D weight with one contracted axis "
                f"(a matmul); {visit.name!r} is a {visit.primitive} with weight shape "
                f"{tuple(w_aval.shape)}. Use a Rule to give this layer 'channel' granularity."
            )
        k = w_aval.shape[contract[0]]
        if k % weights.group_size:
            raise QuantizeError(
                f"quantize: group_size={weights.group_size} does not divide the contracted size "
                f"{k} of {visit.name!r}"
            )
        if config.requantize == "fixed_point":
            raise QuantizeError(
                f"quantize: requantize='fixed_point' cannot combine group-wise weight scales "
                f"({visit.name!r}); use requantize='float' or granularity='channel'"
            )
    return Site(
        name=visit.name,
        primitive=visit.primitive,
        weight_index=wi,
        weights=weights,
        activations=acts,
        rule=rule,
        channel_axis=channel,
        contract_axes=contract,
        reduce_axes=reduce,
        in_loop=in_loop,
    )


def is_concrete(v: Any) -> bool:
    return not C.is_tracer(v)


# ---- integer pass-through ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class QTensor:
    """An activation already in the integer domain (realize only): int8 codes whose real value is
    ``scale * (codes - zero_point)``. It only flows from a chain of pass-through equations into the
    quantized equation that planned the chain (see :func:`plan_chains`)."""

    codes: jax.Array
    scale: Any
    zero_point: Any  # int32, offset into the signed range

    def dequantize(self) -> jax.Array:
        return (self.codes.astype(jnp.int32) - self.zero_point).astype(jnp.float32) * self.scale


_SHAPE_PASS = (
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "slice",
    "rev",
    "copy",
    "copy_p",
    "reduce_window_max",
)
PASS_THROUGH = (*_SHAPE_PASS, "max", "custom_jvp_call")


def _is_zero(atom: Any) -> bool:
    return C.is_literal(atom) and np.ndim(atom.val) == 0 and float(atom.val) == 0.0


def _relu_body(jaxpr: C.Jaxpr) -> bool:
    """``max(x, 0)``, possibly wrapped in single-equation jit calls (``jax.nn.relu``)."""
    while len(jaxpr.eqns) == 1 and jaxpr.eqns[0].primitive.name in INLINE:
        (_, _, sub), *_ = C.subjaxpr_params(jaxpr.eqns[0].params)
        jaxpr = sub.jaxpr if isinstance(sub, C.ClosedJaxpr) else sub
    if len(jaxpr.eqns) != 1 or len(jaxpr.invars) != 1:
        return False
    e = jaxpr.eqns[0]
    return (
        e.primitive.name == "max"
        and jaxpr.invars[0] in e.invars
        and any(_is_zero(a) for a in e.invars)
    )


def passthrough_input(eqn: C.JaxprEqn) -> int | None:
    """Index of the data operand of an equation that commutes exactly with per-tensor quantization
    (shape ops, max pooling, ReLU), else None."""
    prim = eqn.primitive.name
    data = [i for i, v in enumerate(eqn.invars) if not C.is_literal(v)]
    if len(data) != 1 or len(eqn.outvars) != 1:
        return None
    if prim in _SHAPE_PASS:
        return data[0]
    if prim == "max" and any(_is_zero(v) for v in eqn.invars):
        return data[0]
    if prim == "custom_jvp_call":
        body = eqn.params["call_jaxpr"]
        return (
            data[0] if _relu_body(body.jaxpr if isinstance(body, C.ClosedJaxpr) else body) else None
        )
    return None


def plan_chains(source: Program, state: QState) -> dict[str, str]:
    """Equations (by name) whose single-use outputs only feed, through pass-through equations, the
    activation operand of a statically quantized equation: they run on int8 codes in realize."""
    jaxpr = source.jaxpr.jaxpr
    names = source.names
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    uses = C.use_counts(jaxpr.eqns, jaxpr.outvars)
    chains: dict[str, str] = {}
    for i, e in enumerate(jaxpr.eqns):
        name = names[(i,)]
        site = state.sites.get(name)
        if (
            site is None
            or site.activations is None
            or site.activations.granularity != "tensor"
            or name not in state.act
            or name in state.act_absmax  # smoothed: divided per channel before quantizing
            or not jnp.issubdtype(shaped_aval(e.invars[1 - site.weight_index]).dtype, jnp.floating)
        ):
            continue
        v = e.invars[1 - site.weight_index]
        while not C.is_literal(v) and v in producer and uses.get(v) == 1:
            j = producer[v]
            k = passthrough_input(jaxpr.eqns[j])
            if k is None:
                break
            chains[names[(j,)]] = name
            v = jaxpr.eqns[j].invars[k]
    return chains


# ---- the engine ---------------------------------------------------------------------------------


SiteHandler = Callable[[Visit, Site, Any, list[Any]], Any]
"""``handler(visit, site, qweight, invals)``: ``qweight`` is None where the weight needs none
(calibration; params already quantized)."""


class Engine:
    """Rules shared by every mode; ``handler(visit, site, qweight, invals)`` does the mode's work."""

    def __init__(
        self,
        state: QState,
        handler: SiteHandler,
        chains: Mapping[str, str] | None = None,
        grams: Mapping[str, np.ndarray] | None = None,
        *,
        mode: str = "simulate",
    ) -> None:
        self.state = state
        self.chains = dict(chains or {})
        self.grams = dict(grams or {})  # layers to (re)quantize with GPTQ
        self.handler = handler
        self.mode = mode  # "simulate", "observe" or "realize": what a param weight becomes
        self.leaves: dict[int, LeafPlan] = {}
        self.sites: dict[str, Site] = {}
        self.skipped: dict[str, str] = {}
        self.weights: dict[str, QWeight] = dict(state.weights)
        self.matched: set[int] = set()
        self.inlined: set[tuple[Any, ...]] = {()}

    def rules(self) -> dict[str, Any]:
        table: dict[str, Any] = {p: self.site_rule for p in (*QUANTIZABLE, *ELEMENTWISE)}
        table.update({p: self.fold_rule for p in FOLDABLE})
        table.update({p: self.inline_rule for p in INLINE})
        if self.chains:
            table.update({p: self.passthrough_rule for p in PASS_THROUGH})
        return table

    def passthrough_rule(self, visit: Visit, *invals: Any) -> Any:
        """Run a planned pass-through equation on int8 codes (quantizing its input if needed)."""
        site_name = self.chains.get(visit.name)
        if site_name is None:
            fold = visit.primitive in FOLDABLE
            return self.fold_rule(visit, *invals) if fold else visit.bind(*invals)
        k = passthrough_input(visit.eqn)
        assert k is not None  # plan_chains only plans equations with a pass-through input
        x = invals[k]
        if not isinstance(x, QTensor):
            site = self.state.sites[site_name]
            scheme = site.activations
            assert scheme is not None  # plan_chains only plans sites with activation schemes
            params = self.state.act[site_name]
            off = storage_offset(scheme)
            zp = np.float32(params.zero_point)
            q = codes(x, np.float32(params.scale), zp, scheme)
            x = QTensor(
                int8_codes(q + off if off else q),
                np.float32(params.scale),
                np.int32(params.zero_point + off),
            )
        if visit.primitive in ("max", "custom_jvp_call"):  # ReLU: the code of 0 is the zero point
            out = jnp.maximum(x.codes, x.zero_point.astype(np.int8))
        else:
            new = list(invals)
            new[k] = x.codes
            out = visit.bind(*new)
        qt = QTensor(out, x.scale, x.zero_point)
        return [qt] if visit.eqn.primitive.multiple_results else qt

    def fold_rule(self, visit: Visit, *invals: Any) -> Any:
        if any(isinstance(v, WeightRef) for v in invals):
            ref = invals[0]
            if visit.primitive in CHAIN and len(invals) == 1 and isinstance(ref, WeightRef):
                value = chain_value(ref.value, visit.primitive, visit.params, visit.bind)
                return ref.then(visit.primitive, visit.params, value)
            return visit.bind(*(to_float(v) for v in invals))
        if invals and all(is_concrete(v) for v in invals):
            with jax.ensure_compile_time_eval():
                return visit.bind(*invals)
        return visit.bind(*invals)

    def inline_rule(self, visit: Visit, *invals: Any) -> Any:
        subs = C.subjaxpr_params(visit.params)
        if len(subs) != 1 or subs[0][1] is not None:
            return visit.bind(*invals)
        key = subs[0][0]
        if visit.path[:-1] in self.inlined:
            self.inlined.add((*visit.path, key))
        return visit.inline(*invals)

    def site_rule(self, visit: Visit, *invals: Any) -> Any:
        config = self.state.config
        name = visit.name
        weights, acts, rule = resolve(config, name, visit.primitive)
        if rule is not None:
            self.matched.add(rule)
        raw = list(invals)

        def bind_float() -> Any:  # leave the equation as it is (dequantizing any int8 operand)
            return visit.bind(
                *(v.dequantize() if isinstance(v, QTensor) else to_float(v) for v in raw)
            )

        if weights is None:
            if visit.primitive not in ELEMENTWISE or rule is not None:
                self.skipped[name] = "skipped by rule" if rule is not None else "weights=None"
            return bind_float()
        concrete = [
            i
            for i, v in enumerate(raw)
            if isinstance(v, WeightRef) or (not isinstance(v, QTensor) and is_concrete(v))
        ]
        if len(concrete) != 1:
            self.skipped[name] = (
                "no constant (weight) operand" if not concrete else "both operands constant"
            )
            return bind_float()
        wi = concrete[0]
        in_loop = visit.path[:-1] not in self.inlined
        site = make_site(visit, config, wi, weights, acts, rule, in_loop)
        if isinstance(site, str):
            self.skipped[name] = site
            return bind_float()
        if isinstance(raw[wi], WeightRef):
            plan = self.plan_leaf(raw[wi], site, visit)
            if isinstance(plan, str):
                self.skipped[name] = plan
                return bind_float()
        smooth = self.state.smooth.get(name)
        if smooth is not None:
            a_axis = gptq_input_axis(visit, site)
            assert a_axis is not None  # calibrate measures absmax only where it applies
            (k_axis,) = site.contract_axes
            shape = lambda ndim, axis: [-1 if d == axis else 1 for d in range(ndim)]
            a = raw[1 - wi]
            raw[1 - wi] = a / smooth.reshape(shape(a.ndim, a_axis)).astype(a.dtype)
            w = raw[wi]
            if not isinstance(w, WeightRef):
                w = np.asarray(w)
                raw[wi] = (w * smooth.reshape(shape(w.ndim, k_axis))).astype(w.dtype)
            elif not isinstance(w.value, QView):  # (a QArray holds the codes of s W already)
                v = w.value
                raw[wi] = WeightRef(
                    w.leaf, v * smooth.reshape(shape(v.ndim, k_axis)).astype(v.dtype)
                )
        if isinstance(raw[wi], WeightRef):
            return self.param_site(visit, site, raw)
        qw = self.weights.get(name)
        if qw is None or qw.shape != tuple(np.shape(raw[wi])) or name in self.grams:
            qw = quantize_weight(
                raw[wi], site, config.weight_calibration, self.grams.get(name), config.gptq_damp
            )
            self.weights[name] = qw
        if qw.method == "gptq":  # codes not from rounding: the simulated weight is their value
            raw[wi] = dequantized_weight(qw, np.asarray(raw[wi]).dtype)
        self.sites[name] = site
        return self.handler(visit, site, qw, raw)

    def plan_leaf(self, ref: WeightRef, site: Site, visit: Visit) -> LeafPlan | str:
        """The plan of the param leaf behind ``ref`` for this site, shared with an earlier site
        only when both quantize it the same way (a reason to stay float otherwise)."""
        spec = self.state.params
        assert spec is not None  # WeightRefs only enter programs traced with params
        group = site.weights.granularity == "group"
        plan = LeafPlan(
            leaf=ref.leaf,
            path=spec.paths[ref.leaf],
            site=site.name,
            chain=ref.chain,
            scheme=site.weights,
            channel_axis=leaf_axis(ref.chain, site.channel_axis),
            group_axis=leaf_axis(ref.chain, site.contract_axes[0]) if group else None,
            shape=tuple(spec.avals[ref.leaf].shape),
            dtype=np.dtype(spec.avals[ref.leaf].dtype).name,
        )
        first = self.leaves.get(ref.leaf)
        if first is None:
            known = self.state.leaves.get(ref.leaf)
            if isinstance(ref.value, QView) and (known is None or known.site != site.name):
                raise QuantizeError(
                    f"quantize: the program's quantization sites no longer match its state: "
                    f"param {plan.path} reaches {site.name!r}, planned for "
                    f"{None if known is None else known.site!r}. Run the passes that change "
                    "the program before jaxq.quantize.annotate."
                )
            self.leaves[ref.leaf] = plan
            return plan
        same = (first.scheme, first.channel_axis, first.group_axis) == (
            plan.scheme,
            plan.channel_axis,
            plan.group_axis,
        )
        smoothed = site.name in self.state.smooth or first.site in self.state.smooth
        if not same or smoothed:
            return (
                f"param {plan.path} is quantized for {first.site!r} with another scheme or "
                "layout; a Rule giving both layers one scheme quantizes it for both"
            )
        return first

    def param_site(self, visit: Visit, site: Site, raw: list[Any]) -> Any:
        """A site whose weight is a param leaf: a float value (the program computes its scales,
        or, in calibration, only observes) or a QArray (realize: the codes are inputs)."""
        wi = site.weight_index
        ref = raw[wi]
        self.sites[site.name] = site
        new = list(raw)
        if isinstance(ref.value, QView):
            if self.mode == "realize":  # integer code on the QArray's codes
                new[wi] = None
                return self.handler(visit, site, view_qweight(ref.value, site), new)
            new[wi] = ref.value.dequantize()  # simulate on quantized params: the weight's value
            return self.handler(visit, site, None, new)
        new[wi] = ref.value
        if self.mode != "simulate":
            return self.handler(visit, site, None, new)
        return self.handler(
            visit, site, traced_qweight(ref.value, site, self.state.config.weight_calibration), new
        )


def lower(
    state: QState,
    handler: SiteHandler,
    *,
    mode: str = "simulate",
    quantized_params: bool = False,
    integer_chains: bool = False,
    grams: Mapping[str, np.ndarray] | None = None,
    source: Program | None = None,
) -> tuple[Program, Engine]:
    """Rewrite the float program (``source``, default the state's) through the engine's rules
    (``rewrite`` re-traces it). ``integer_chains`` (realize) runs planned pass-through equations
    on int8 codes; ``grams`` (calibrate) re-quantizes those layers' weights with GPTQ. With params
    (``state.params``) the result takes QArrays at the planned leaves when ``quantized_params``
    (always in realize), float params otherwise."""
    source = state.source if source is None else source
    chains = plan_chains(source, state) if integer_chains else None
    engine = Engine(state, handler, chains, grams, mode=mode)
    try:
        if state.params is None:
            out = rewrite(source, engine.rules(), scope="quantize")
        else:
            quantized = quantized_params or mode == "realize"
            in_tree, specs, paths = param_signature(source, state, quantized)
            closed = retrace(
                source,
                engine.rules(),
                specs,
                lambda flat: source_inputs(state, in_tree, flat, quantized),
                scope="quantize",
                coerce=to_float,
            )
            out = source.with_jaxpr(closed, in_tree=in_tree, in_paths=paths)
    except RewriteError as e:
        raise_cause(e)
        raise
    return out, engine


def param_signature(
    source: Program, state: QState, quantized: bool
) -> tuple[Any, list[Any], tuple[str, ...]]:
    """``(in_tree, flat input specs, input paths)`` of the program with params: QArray specs at
    the planned leaves when ``quantized``, else the float program's own."""
    spec = state.params
    assert spec is not None  # only programs traced with params have a param signature
    flat = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in source.jaxpr.in_avals]
    args, kwargs = jax.tree.unflatten(source.in_tree, flat)
    leaves: list[Any] = flat[spec.start : spec.start + spec.count]
    if quantized:
        leaves = [state.leaves[i].spec() if i in state.leaves else x for i, x in enumerate(leaves)]
    args = (*args[: spec.argnum], jax.tree.unflatten(spec.tree, leaves), *args[spec.argnum + 1 :])
    with_paths, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    return in_tree, [x for _, x in with_paths], tuple(path_str(p) for p, _ in with_paths)


def source_inputs(state: QState, in_tree: Any, flat: Any, quantized: bool) -> list[Any]:
    """The float program's input values for a call with ``in_tree``: param leaves as WeightRefs
    (QArrays seen as QViews), everything else as given."""
    spec = state.params
    assert spec is not None  # only programs traced with params have params to wrap
    args, kwargs = jax.tree.unflatten(in_tree, list(flat))
    leaves = jax.tree.leaves(args[spec.argnum], is_leaf=is_qarray)
    refs = [
        WeightRef(i, QView.of(x))
        if isinstance(x, QArray)
        else WeightRef(i, x)
        if not quantized and float_leaf(x)
        else x
        for i, x in enumerate(leaves)
    ]
    before = jax.tree.leaves(args[: spec.argnum])
    after = jax.tree.leaves((args[spec.argnum + 1 :], kwargs))
    return [*before, *refs, *after]


def raise_cause(e: BaseException) -> None:
    """Re-raise a QuantizeError that a walker rule raised (the walker wraps rule errors)."""
    cause = e.__cause__
    while cause is not None:
        if isinstance(cause, QuantizeError):
            raise cause.with_traceback(None) from None
        cause = cause.__cause__


def simulate_handler(state: QState) -> SiteHandler:
    def handle(visit: Visit, site: Site, qw: QWeight | None, invals: list[Any]) -> Any:
        wi = site.weight_index
        new = list(invals)
        if qw is not None:  # (None: the weight is a quantized param's value already)
            w_fq = fake_quant_weight(invals[wi], qw, site)
            new[wi] = w_fq.astype(jnp.asarray(invals[wi]).dtype)
        scheme = site.activations
        if scheme is not None:
            a = invals[1 - wi]
            scale, zp = act_qparams(a, scheme, site, state.act.get(site.name))
            new[1 - wi] = fake_quant_act(a, scale, zp, scheme, site)
        y = visit.bind(*new)
        out = state.act.get(site.name + ":out")
        if state.config.requantize == "fixed_point" and out is not None and scheme is not None:
            y = fake_quant_act(y, np.float32(out.scale), np.float32(out.zero_point), scheme, site)
        return y

    return handle
