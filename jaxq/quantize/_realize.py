"""realize: lower annotated equations to integer code that XLA runs.

* Weights are quantized once (``QWeight``) and stored as int8 constants, or packed two per byte for
  4 bits or fewer (unpacked with two shifts and a concatenate at run time).
* Weight-only layers run the float op on the codes and scale its output (see ``_weight_only``).
* Activations are quantized with core ops (divide, round, add, clip, cast) to int8: unsigned schemes
  are shifted into the signed range (their zero point shifts with them), because XLA:CPU's u8 x s8
  dot never takes its fast path.
* ``dot_general`` / ``conv_general_dilated`` run as int8 x int8 -> int32 with the original dimension
  numbers; zero-point terms are expanded as in TVM's QNN lowering
  (``sum((a - za)(w - zw)) = sum(a w) - za sum(w) - zw sum(a) + K za zw``), the weight sums
  precomputed. Padded positions of a convolution hold code 0; the zero-point terms of each
  window's real positions are convolutions of a mask (constants XLA folds).
* Convolutions XLA:CPU has no fast int8 kernel for carry their exact integer sums in f32 (bound
  < 2**24): any layout but channels-last, too few channels, and (on some builds) those whose
  output is max-pooled, as a float convolution fuses with its pooling (``_tuning``); those with
  at most 16 products per output (a 3x3 kernel on one channel) run as shifted slices times weight
  rows in one fused loop.
* Requantize: the int32 accumulator times the float scale ``sa * sw`` (fused by XLA), or an
  integer-only fixed-point multiplier and rounding shift to int8 codes (``_fixed_point``), which are
  then dequantized at the float boundary.
* Matmuls of very few rows (batch 1) carry their integer sums in f32 where the running XLA's s8
  kernel is slow for them and the sums provably stay below 2**24 (bit-exact with the int32
  result); or a single row is duplicated so the s8 dot takes the fast kernel. Which XLA build
  wants which is a measured table per jax version (``_tuning``, ``benchmarks/bench_kernels.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxq import _compat as C
from jaxq._program import Program
from jaxq._walk import Visit
from jaxq.quantize import _fixed_point as F
from jaxq.quantize._annotate import check_sites, float_source
from jaxq.quantize._arith import act_qparams, codes, int8_codes, storage_offset
from jaxq.quantize._chains import QTensor, few_rows
from jaxq.quantize._config import EMBEDDING, QUANTIZABLE, QConfig
from jaxq.quantize._intsums import F32_EXACT, int_dot, sums_in_chunks
from jaxq.quantize._lower import SiteHandler, lower
from jaxq.quantize._qarray import nibbles
from jaxq.quantize._qarray import pack_axis as pack_axis
from jaxq.quantize._qarray import pack_int4 as pack_int4
from jaxq.quantize._qarray import unpack_int4 as unpack_int4
from jaxq.quantize._sites import dot_to_out, nonfinite_rows, poison_rows
from jaxq.quantize._state import (
    QState,
    QuantizeError,
    QWeight,
    Site,
    get_state,
    shaped_aval,
    with_state,
)
from jaxq.quantize._tuning import current_tuning
from jaxq.transform import Pass, program_pass

# ---- weight storage -----------------------------------------------------------------------------


def weight_codes(qw: QWeight, after: Any = None) -> jax.Array:
    """The weight codes as an int8 value of the program: a constant (unpacked from one for 4 bits
    or fewer), or a param's codes. With ``after`` (an activation), a param's codes are available
    only once it is (see :func:`_in_turn`), and 4-bit codes are unpacked after that point."""
    if _host(qw.codes):
        if qw.bits <= 4:
            return unpack_int4(jnp.asarray(pack_int4(qw.codes)), qw.codes.shape)
        return jnp.asarray(qw.codes)
    if after is None or not current_tuning().weights_in_turn:
        return qw.codes
    if qw.packed is not None:
        return unpack_int4(_in_turn(after, qw.packed), qw.codes.shape)
    return _in_turn(after, qw.codes)


def _in_turn(activation: Any, codes: jax.Array) -> jax.Array:
    """``codes``, available to XLA only once ``activation`` is. A param's codes depend on params
    alone, so XLA would otherwise convert every layer's weight up front and hold them all at
    once: a weight-only model's temporaries were the size of its float weights."""
    return lax.optimization_barrier((activation, codes))[1]


def _nonzero(v: Any) -> bool:
    """Whether a weight zero point may be non-zero: a host one is looked at; a param's is not
    known until run time (symmetric params have a host zero)."""
    return bool(np.any(v != 0)) if _host(v) else True


# ---- helpers ------------------------------------------------------------------------------------


def _code_sums(qw: QWeight, axes: tuple[int, ...]) -> Any:
    """The codes' sums over ``axes`` (kept): a param's stored ones (a QArray's ``sums``, so no
    call reads the weight twice), else folded on the host, or summed in the program."""
    if qw.sums is not None:
        return qw.sums
    return _xp(qw.codes).sum(qw.codes.astype(np.int32), axis=tuple(axes), keepdims=True)


def _host(*vs: Any) -> bool:
    """True when every value is a host constant: then scale arithmetic is folded in numpy and
    lands in the program as one constant."""
    return all(isinstance(v, (np.ndarray, np.generic, int, float)) for v in vs)


def _xp(*vs: Any) -> Any:
    return np if _host(*vs) else jnp


def _check_static_act(state: QState, site: Site, act: Any, who: str) -> None:
    unreached = state.calibration.get("unreached", ())  # (run-time scales, as calibrate warned)
    if act is None and site.static_act(state.config.dynamic) and site.name not in unreached:
        raise QuantizeError(
            f"{who}: layer {site.name!r} has no calibrated activation scale.\n"
            "Run jaxq.quantize.calibrate(data) before realize, or use QConfig(dynamic=True) to "
            "compute activation scales at run time."
        )


def _check_bits(site: Site) -> None:
    for side, s in (("weights", site.weights), ("activations", site.activations)):
        if s is not None and s.bits > 8:
            raise QuantizeError(
                f"realize: {site.name!r} uses {s.bits}-bit {side}; integer code supports at most "
                "8 bits. Use mode='simulate' for wider codes, or a Rule with bits <= 8."
            )


def _check_overflow(site: Site, qw: QWeight, a_scheme: Any, za: Any) -> int:
    """Bound every partial sum and zero-point term on the host: int32 must hold them (else a clear
    error), and below 2**24 they are exact in f32 too."""
    qmin, qmax = a_scheme.qrange
    off = storage_offset(a_scheme)
    amax_raw = max(abs(qmin + off), abs(qmax + off))
    amax_centered = qmax - qmin if za is None else max(abs(qmin - za), abs(qmax - za))
    axes = site.contract_axes
    k = math.prod(qw.codes.shape[d] for d in axes)
    if _host(qw.codes, qw.zero_point):
        c = qw.codes.astype(np.int64)
        raw = np.abs(c).sum(axis=axes).max() * amax_raw
        centered = np.abs(c - qw.zero_point).sum(axis=axes).max() * amax_centered
        zero_point_terms = int(np.abs(qw.zero_point).max()) * k * amax_raw  # zw sum(a), K za zw
    else:  # a param's codes are not known here: the bound of any codes of this scheme
        ws = site.weights
        half = 2 ** (ws.bits - 1)
        raw = k * half * amax_raw
        if _host(qw.zero_point) and not _nonzero(qw.zero_point):  # symmetric: |code| <= half
            centered = k * (half - int(ws.narrow_range)) * amax_centered
            zero_point_terms = 0
        else:
            centered = k * (2 * half - 1) * amax_centered
            zero_point_terms = k * 2 * half * amax_raw
    bound = max(int(raw), int(centered), zero_point_terms)
    if bound >= 2**31:
        raise QuantizeError(
            f"realize: the int32 accumulator of {site.name!r} could overflow (bound {bound} over "
            f"{k} products >= 2**31). Use fewer bits, or skip this layer with a Rule."
        )
    return bound


# ---- the integer lowerings ----------------------------------------------------------------------


def _quantize_act(
    a: Any, scheme: Any, sa: Any, za: Any, dtype: Any = jnp.int8
) -> tuple[jax.Array, Any]:
    """Activation codes (offset into the signed range) as ``dtype``, and the zero point."""
    if isinstance(a, QTensor):  # already quantized upstream (pass-through chain)
        return a.codes.astype(dtype), a.zero_point
    off = storage_offset(scheme)
    q = codes(a, sa, za, scheme)
    q = q + off if off else q
    qa = int8_codes(q) if dtype == jnp.int8 else q.astype(dtype)
    za_s = za + off if off else za
    return qa, (np.int32(za_s) if _host(za) else za_s.astype(jnp.int32))


def _int_dot(
    visit: Visit,
    site: Site,
    qw: QWeight,
    a: jax.Array,
    sa: Any,
    za: Any,
    bound: int,
    nan_rows: bool,
    dn: Any = None,
) -> tuple[jax.Array, Any, bool]:
    """Accumulator of ``sum((qa - za)(qw - zw))`` (int32, or exact integers in f32 for one row),
    the float scale of each output, and whether rows holding NaN or Inf already come out NaN
    (f32 codes carry NaN through the dot: no separate mask is needed). ``bound``: of any sum
    (:func:`_check_overflow`); ``dn``: the dimension numbers to compute with (default: the
    equation's)."""
    dn = visit.params["dimension_numbers"] if dn is None else dn
    (lc, rc), (lb, rb) = dn
    wi = site.weight_index
    ai = 1 - wi
    scheme = site.activations
    assert scheme is not None  # realize_handler lowers only sites with activation schemes
    codes_of = lambda: weight_codes(qw, a.codes if isinstance(a, QTensor) else a)
    a_shape = a.codes.shape if isinstance(a, QTensor) else a.shape
    ranks = (len(a_shape), len(qw.shape)) if wi == 1 else (len(qw.shape), len(a_shape))
    a_contract = (lc, rc)[ai]
    a_free = [d for d in range(len(a_shape)) if d not in a_contract and d not in (lb, rb)[ai]]
    tune = current_tuning()
    few = few_rows(a_shape, a_contract, tune.float_carry_max_rows)
    rows = _pieces(visit, site, qw) if dn == visit.params["dimension_numbers"] else None
    # (a piece's sums stay below 2**24 where whole rows' may not: each is added in int32 then)
    if rows is not None and rows * 2 ** (site.weights.bits + scheme.bits) >= 2**24:
        rows = None
    if few and (bound < 2**24 or rows is not None):
        # exact integer sums carried in f32 (where this XLA's s8 kernel is slow for so few rows)
        # (the zero point is subtracted from the codes first: still integers, and no correction)
        qa, za_s = _quantize_act(a, scheme, sa, za, jnp.float32)
        if not (scheme.symmetric and scheme.signed):
            qa = qa - (za_s.astype(np.float32) if _host(za_s) else za_s.astype(jnp.float32))
        native = nan_rows and not isinstance(a, QTensor) and bound < 2**24
        if native:  # a NaN code makes its whole row of sums NaN (no reduction, fused)
            qa = jnp.where(jnp.isfinite(a), qa, jnp.float32(jnp.nan))
        if rows is not None:
            acc = _piecewise_dot(visit, site, qw, qa, rows, int_sums=bound >= 2**24)
        else:
            wf = codes_of().astype(jnp.float32)
            acc = lax.dot_general(
                *((qa, wf) if wi == 1 else (wf, qa)), dn, preferred_element_type=jnp.float32
            )
        fin = _dot_finish(acc, site, qw, qa, za_s, sa, dn, ranks, a_contract, centered=True)
        return (*fin, native)
    qa, za_s = _quantize_act(a, scheme, sa, za)
    one_row = wi == 1 and not lb and a_free and math.prod(qa.shape[d] for d in a_free) == 1
    # a 1-row s8 dot is slow on some XLA:CPU builds (widened to s32); 2 rows take the fast kernel
    pad_rows = one_row and (tune.s8_pad_single_row or few)
    qa_in = jnp.concatenate([qa, qa], axis=a_free[0]) if pad_rows else qa
    acc = int_dot(*((qa_in, codes_of()) if wi == 1 else (codes_of(), qa_in)), dn)
    if pad_rows:
        acc = lax.slice_in_dim(acc, 0, 1, axis=0)
    return (*_dot_finish(acc, site, qw, qa, za_s, sa, dn, ranks, a_contract), False)


def _dot_finish(
    acc: jax.Array,
    site: Site,
    qw: QWeight,
    qa: jax.Array,
    za_s: Any,
    sa: Any,
    dn: Any,
    ranks: tuple[int, int],
    a_contract: Any,
    centered: bool = False,
) -> tuple[jax.Array, Any]:
    """Zero-point terms and output scale. ``centered``: ``qa`` already had ``za`` subtracted."""
    (lc, rc), _ = dn
    wi = site.weight_index
    ai = 1 - wi
    scheme = site.activations
    assert scheme is not None  # realize_handler lowers only sites with activation schemes
    w_contract = (lc, rc)[wi]
    zp_a = not (scheme.symmetric and scheme.signed) and not centered
    zp_w = _nonzero(qw.zero_point)
    to_out_a = lambda v: dot_to_out(v, ai, dn, ranks)
    to_out_w = lambda v: dot_to_out(v, wi, dn, ranks)
    if zp_a:
        acc = acc - to_out_a(za_s) * to_out_w(_code_sums(qw, w_contract))
    if zp_w:
        k = math.prod(qw.codes.shape[d] for d in w_contract)
        zw = qw.zero_point
        rowsum = jnp.sum(qa.astype(jnp.int32), axis=a_contract, keepdims=True)
        acc = acc - to_out_w(zw) * to_out_a(rowsum)
        if zp_a:
            acc = acc + k * to_out_a(za_s) * to_out_w(zw)
    scale = to_out_a(sa) * to_out_w(qw.scale)
    return acc, scale


def _dequantized_dot(
    visit: Visit, site: Site, qw: QWeight, invals: list[Any], sa: Any, za: Any
) -> jax.Array:
    """Group-wise weight scales: the float op on the dequantized activation codes and weights,
    as simulated. The integer route needs one int32 dot per group, whose ``[groups, rows, out]``
    sums XLA writes out (W4 group(32) A8 at 2048 x 2048: 0.09x float, 256 MiB of temporaries)."""
    scheme = site.activations
    assert scheme is not None  # realize_handler lowers only sites with activation schemes
    wi = site.weight_index
    new = list(invals)
    qa, za_s = _quantize_act(invals[1 - wi], scheme, sa, za)
    a_dtype = shaped_aval(visit.eqn.invars[1 - wi]).dtype
    new[1 - wi] = ((qa.astype(jnp.int32) - za_s).astype(jnp.float32) * sa).astype(a_dtype)
    return _dequantized_op(visit, site, qw, new)


def _channels_last(dn: Any) -> bool:
    """NHWC / HWIO / NHWC (or its 1-D and 3-D kin): the layout of XLA:CPU's int8 kernel."""
    nsp = len(dn.lhs_spec) - 2
    spatial = tuple(range(1, nsp + 1))
    act = (0, nsp + 1, *spatial)
    return dn.lhs_spec == act and dn.out_spec == act and dn.rhs_spec == (nsp + 1, nsp, *range(nsp))


def _conv_by_taps(x: jax.Array, w: jax.Array, p: Any, out_shape: tuple[int, ...]) -> jax.Array:
    """``conv_general_dilated`` (no input dilation, one group) as a sum over kernel positions and
    input channels of strided slices of the padded input times the weight's output-channel row."""
    dn = p["dimension_numbers"]
    xc = jnp.transpose(x, dn.lhs_spec)  # [N, C, spatial...]
    wc = jnp.transpose(w, dn.rhs_spec)  # [O, C, kernel...]
    out_sp = [out_shape[d] for d in dn.out_spec[2:]]
    zero = np.zeros((), xc.dtype)
    xc = lax.pad(xc, zero, [(0, 0, 0), (0, 0, 0), *((lo, hi, 0) for lo, hi in p["padding"])])
    row_shape = (1, -1) + (1,) * len(out_sp)
    acc = None
    strides = p["window_strides"]
    for c in range(wc.shape[1]):
        for k in itertools.product(*(range(n) for n in wc.shape[2:])):
            first = [i * r for i, r in zip(k, p["rhs_dilation"], strict=True)]
            last = [f + (n - 1) * s for f, n, s in zip(first, out_sp, strides, strict=True)]
            xs = lax.slice(
                xc, [0, c, *first], [xc.shape[0], c + 1, *(v + 1 for v in last)], (1, 1, *strides)
            )
            term = xs * wc[(slice(None), c, *k)].reshape(row_shape)
            acc = term if acc is None else acc + term
    assert acc is not None  # a kernel has at least one position and channel
    return jnp.transpose(acc, tuple(int(d) for d in np.argsort(dn.out_spec)))


def _conv_as_dot(x: jax.Array, w: jax.Array, p: Any, padding: Any) -> jax.Array:
    """A channels-last int8 convolution (one group, no input dilation) as one s8 dot: each
    output position's window of codes side by side (im2col), times the HWIO weight as a
    [window x C, O] matrix (see ``Tuning.conv_im2col_bytes``)."""
    nsp = x.ndim - 2
    n, c = x.shape[0], x.shape[-1]
    # (the codes written once: fused into the windows, their quantize ran once per window)
    x = lax.optimization_barrier(x)
    x = lax.pad(
        x, np.zeros((), x.dtype), [(0, 0, 0), *((lo, hi, 0) for lo, hi in padding), (0, 0, 0)]
    )
    kernel, strides, dilation = w.shape[:nsp], p["window_strides"], p["rhs_dilation"]
    out = [
        (x.shape[1 + i] - (kernel[i] - 1) * dilation[i] - 1) // strides[i] + 1 for i in range(nsp)
    ]
    windows = []
    for k in itertools.product(*(range(size) for size in kernel)):
        first = [i * d for i, d in zip(k, dilation, strict=True)]
        last = [f + (o - 1) * s + 1 for f, o, s in zip(first, out, strides, strict=True)]
        windows.append(lax.slice(x, [0, *first, 0], [n, *last, c], [1, *strides, 1]))
    cols = jnp.concatenate(windows, axis=-1) if len(windows) > 1 else windows[0]
    dn = (((nsp + 1,), (0,)), ((), ()))
    return lax.dot_general(cols, w.reshape(-1, w.shape[-1]), dn, preferred_element_type=jnp.int32)


def _im2col_bytes(w_shape: tuple[int, ...], out_shape: Any) -> Any:
    """Bytes of the int8 windows :func:`_conv_as_dot` writes (channels-last shapes)."""
    return math.prod(out_shape[:-1]) * math.prod(w_shape[:-1])


def _conv_in_chunks(
    site: Site, xc: jax.Array, wc: jax.Array, conv: Any, p: Any, per_product: int
) -> jax.Array:
    """The integer sums of a convolution of centered f32 codes without an int8 convolution:
    f32 convolutions of chunks of each group's input channels (``sums_in_chunks``; each product
    at most ``per_product``)."""
    dn = p["dimension_numbers"]
    positions = math.prod(wc.shape[d] for d in dn.rhs_spec[2:])
    per_channel = positions * per_product
    if per_channel >= F32_EXACT:
        raise QuantizeError(
            f"realize: the integer sums of {site.name!r} can reach 2**24 over one input channel "
            f"(a kernel of {positions} positions), and this platform has no int8 convolution to "
            "hold them (a GPU): use fewer bits or symmetric weights for this layer, or skip it "
            "with a Rule"
        )
    groups = p["feature_group_count"]
    c_axis = dn.lhs_spec[1]
    per_group = wc.shape[dn.rhs_spec[1]]  # (the kernel's input channels are one group's)

    def lhs_chunk(lo: int, hi: int) -> jax.Array:  # channels [lo, hi) of every group
        if groups == 1:
            return lax.slice_in_dim(xc, lo, hi, axis=c_axis)
        shape = xc.shape
        split = xc.reshape(*shape[:c_axis], groups, per_group, *shape[c_axis + 1 :])
        part = lax.slice_in_dim(split, lo, hi, axis=c_axis + 1)
        return part.reshape(*shape[:c_axis], groups * (hi - lo), *shape[c_axis + 1 :])

    return sums_in_chunks(
        lambda lo, hi: conv(
            lhs_chunk(lo, hi), lax.slice_in_dim(wc, lo, hi, axis=dn.rhs_spec[1]), None
        ),
        per_group,
        per_channel,
    )


_EPILOGUE = ("add", "sub", "mul", "max", "min", "custom_jvp_call", "pjit", "jit")
"""Equations that may lie between a convolution and its pooling (shape-preserving ones only)."""


def pooled_outputs(source: Program) -> set[str]:
    """Names of the equations whose output reaches a max pooling only through elementwise
    equations of one use each (a bias, ReLU): the convolutions XLA:CPU can fuse with their
    pooling when they run in float (see ``Tuning.s8_pooled_conv_min_channels``)."""
    jaxpr = source.jaxpr.jaxpr
    consumer = {v: e for e in jaxpr.eqns for v in e.invars if not C.is_literal(v)}
    uses = C.use_counts(jaxpr.eqns, jaxpr.outvars)
    pooled = set()
    for i, e in enumerate(jaxpr.eqns):
        if e.primitive.name != "conv_general_dilated":
            continue
        (v,) = e.outvars
        shape = shaped_aval(v).shape
        while uses.get(v) == 1 and v in consumer:
            nxt = consumer[v]
            if nxt.primitive.name == "reduce_window_max":
                pooled.add(source.names[(i,)])
                break
            if nxt.primitive.name not in _EPILOGUE or len(nxt.outvars) != 1:
                break
            v = nxt.outvars[0]
            if shaped_aval(v).shape != shape:
                break
    return pooled


def _int_conv(
    visit: Visit,
    site: Site,
    qw: QWeight,
    a: jax.Array,
    sa: Any,
    za: Any,
    exact_f32: bool,
    pooled: bool,
) -> tuple[jax.Array, Any]:
    p = visit.params
    dn = p["dimension_numbers"]
    scheme = site.activations
    assert scheme is not None  # realize_handler lowers only sites with activation schemes
    wq = weight_codes(qw, a.codes if isinstance(a, QTensor) else a)
    padding, lhs_dil = p["padding"], p["lhs_dilation"]
    zp_a = not (scheme.symmetric and scheme.signed)
    # Padded (and dilation-inserted) positions hold code 0, not the zero point, so the zero-point
    # terms are sums over the *real* positions of each window: convolutions of a one-sample mask of
    # ones (constants XLA folds), instead of padding the activations with the zero point.
    borders = any(lo or hi for lo, hi in padding) or any(d != 1 for d in lhs_dil)
    out_shape = shaped_aval(visit.eqn.outvars[0]).shape
    out_rank = len(dn.out_spec)

    def per_channel(v: Any) -> Any:  # a weight-channel vector -> broadcastable to the output
        if np.ndim(v) == 0:
            return v
        shape = [1] * out_rank
        shape[dn.out_spec[1]] = -1
        return _xp(v).reshape(v, shape)

    def per_sample(v: Any) -> Any:  # an activation scalar or per-sample (token) value
        if np.ndim(v) == 0:
            return v
        shape = [1] * out_rank
        shape[dn.out_spec[0]] = -1
        return _xp(v).reshape(v, shape)

    def conv(lhs: jax.Array, rhs: jax.Array, out_dtype: Any = jnp.int32) -> jax.Array:
        return lax.conv_general_dilated(
            lhs,
            rhs,
            p["window_strides"],
            padding,
            lhs_dil,
            p["rhs_dilation"],
            dn,
            p["feature_group_count"],
            1,
            None,
            preferred_element_type=out_dtype,
        )

    tune = current_tuning()
    taps = math.prod(wq.shape[d] for d in dn.rhs_spec[1:])  # products per output
    direct = (
        taps <= tune.conv_taps_max
        and p["feature_group_count"] == 1
        and all(d == 1 for d in lhs_dil)
    )
    a_shape = a.codes.shape if isinstance(a, QTensor) else a.shape
    c_in, c_out = a_shape[dn.lhs_spec[1]], wq.shape[dn.rhs_spec[0]]
    min_channels = tune.s8_pooled_conv_min_channels if pooled else tune.s8_conv_min_channels
    windows = _im2col_bytes(wq.shape, out_shape)  # (symbolic under a polymorphic export)
    im2col = (
        _channels_last(dn)
        and p["feature_group_count"] == 1
        and all(d == 1 for d in lhs_dil)
        and isinstance(windows, int)
        and tune.conv_im2col_bytes[0] <= windows <= tune.conv_im2col_bytes[1]
    )
    # (as a dot, narrow channels run fast too: 16 -> 16 1.05x f32's speed, 0.14x as XLA's s8
    # convolution; before a pooling the f32 sums still fuse with it)
    s8_fast = (
        _channels_last(dn)
        and all(d == 1 for d in lhs_dil)
        and (max(c_in, c_out) >= min_channels or (im2col and not pooled))
    )
    # (where XLA:CPU's s8 convolution is slow, sums past f32's exact range are carried in f32
    # chunks of input channels, as on a GPU, where one channel's fit: a transposed convolution
    # (input dilation), 4 x 16 x 16, 64 -> 64, 16.5 ms in s8 against 1.4 ms; NCHW 128 -> 128
    # 143 ms against 6.8 ms, float 5.7 ms)
    w_centered = 2**qw.bits if _nonzero(qw.zero_point) else 2 ** (qw.bits - 1)
    per_product = w_centered * (scheme.qrange[1] - scheme.qrange[0])
    chunks = math.prod(wq.shape[d] for d in dn.rhs_spec[2:]) * per_product < 2**24
    f32_carry = (exact_f32 and direct) or (not s8_fast and (exact_f32 or chunks))
    f32_carry = f32_carry or not tune.s8_conv
    qa, za_s = _quantize_act(a, scheme, sa, za, jnp.float32 if f32_carry else jnp.int8)
    if f32_carry:
        # XLA:CPU runs an int8 convolution fast only in channels-last layout (NHWC / HWIO) and
        # with enough channels (the tuning table); otherwise it widens to an s32 loop (measured,
        # batch 256, 8x8, 3x3: NCHW 32 -> 64 155 ms against 3.4 ms NHWC; NHWC 16 -> 16 6x the f32
        # time on jax 0.10.2 and 0.12), and transposing the operands does not help (XLA folds the
        # transposes back). The exact integer sums are carried in f32 instead (bound < 2**24):
        # centered codes, so padding is a real zero and no zero-point term is left.
        centered = lambda q, z: (
            q.astype(jnp.float32)
            - (np.asarray(z, np.float32) if _host(z) else z.astype(jnp.float32))
        )
        # (a per-sample zero point is shaped like the input already)
        xc, wc = centered(qa, za_s), centered(wq, qw.zero_point)
        if exact_f32:
            acc = _conv_by_taps(xc, wc, p, out_shape) if direct else conv(xc, wc, None)
        else:  # (no fast s8 convolution: f32 sums of input-channel chunks, added in int32)
            acc = _conv_in_chunks(site, xc, wc, conv, p, per_product)
        w_scale = qw.scale.reshape(-1) if qw.scale.size > 1 else qw.scale.reshape(())
        return acc, per_sample(sa) * per_channel(w_scale)
    host = _host(qw.codes)
    if borders and zp_a and not host and np.ndim(za_s) == 0 and all(d == 1 for d in lhs_dil):
        # A param's weight sums are not constants XLA could fold, so the mask convolutions
        # below would run on every call: pad with the zero point instead (one pad, no
        # border terms), then every window sums over all its positions.
        pads = [(0, 0, 0)] * qa.ndim
        for d, (lo, hi) in zip(dn.lhs_spec[2:], padding, strict=True):
            pads[d] = (lo, hi, 0)
        qa = lax.pad(qa, jnp.asarray(za_s).astype(qa.dtype), pads)
        padding = tuple((0, 0) for _ in padding)
        borders = False
    acc = _conv_as_dot(qa, wq, p, padding) if im2col else conv(qa, wq)

    mask_shape = list(qa.shape)
    mask_shape[dn.lhs_spec[0]] = 1
    mask = jnp.ones(mask_shape, jnp.int8)
    ones_k = jnp.ones(wq.shape, jnp.int8)
    w_axes = tuple(d for d in range(wq.ndim) if d != site.channel_axis)
    if zp_a:
        # with borders: [1, out spatial..., O], the sums of w over each window's real positions
        wsum = conv(mask, wq) if borders else per_channel(_code_sums(qw, w_axes).reshape(-1))
        acc = acc - per_sample(za_s) * wsum
    zw = qw.zero_point.reshape(-1) if qw.zero_point.size > 1 else qw.zero_point.reshape(())
    if _nonzero(zw):
        zw_out = per_channel(zw)
        acc = acc - zw_out * conv(qa, ones_k)
        if zp_a:
            count: jax.Array | np.int32
            if borders:
                count = conv(mask, ones_k)
            else:
                count = np.int32(math.prod(qw.codes.shape[d] for d in w_axes))
            acc = acc + per_sample(za_s) * zw_out * count
    w_scale = qw.scale.reshape(-1) if qw.scale.size > 1 else qw.scale.reshape(())
    return acc, per_sample(sa) * per_channel(w_scale)


def _dequantized_weight(visit: Visit, site: Site, qw: QWeight, activation: Any) -> jax.Array:
    """``(q - zp) * s`` in the weight operand's dtype, as simulated, once ``activation`` is
    computed (see :func:`_in_turn`)."""
    w = weight_codes(qw, activation).astype(jnp.float32)
    if _nonzero(qw.zero_point):
        w = w - qw.zero_point.astype(np.float32)
    return (w * qw.scale).astype(shaped_aval(visit.eqn.invars[site.weight_index]).dtype)


def _dequantized_op(visit: Visit, site: Site, qw: QWeight, invals: list[Any]) -> jax.Array:
    """The float op on ``invals`` with the weight dequantized as simulated: a piece of the
    contracted axis at a time where :func:`_pieces` says so, else whole."""
    rows = _pieces(visit, site, qw)
    if rows is not None:
        return _piecewise_dot(visit, site, qw, invals[1 - site.weight_index], rows)
    new = list(invals)
    new[site.weight_index] = _dequantized_weight(visit, site, qw, invals[1 - site.weight_index])
    return visit.bind(*new)


def _pieces(visit: Visit, site: Site, qw: QWeight) -> int | None:
    """Contracted rows per piece for a matmul that dequantizes its weight a piece at a time (its
    output smaller than its weight: few rows), or None to dequantize it whole. A constant weight
    (closed over) is dequantized whole: XLA folds that into a float constant when it compiles,
    so no call converts it, and a loop would convert it on every call (bench_quantize's MLP at
    batch 1, closed over, W8A8: 0.81-0.82x float's speed in pieces, 0.98-1.01x whole)."""
    rows = current_tuning().weight_pieces
    out_size = shaped_aval(visit.eqn.outvars[0]).size  # (symbolic under a polymorphic export)
    if not rows or site.primitive != "dot_general" or not isinstance(out_size, int):
        return None
    if _host(qw.codes):
        return None
    (lc, rc), (lb, _) = visit.params["dimension_numbers"]
    contract = (lc, rc)[site.weight_index]
    if lb or len(contract) != 1 or out_size >= qw.codes.size:
        return None
    if site.weights.granularity == "group":  # (2-D, grouped along the contracted axis)
        rows = math.lcm(rows, site.weights.group_size or 1)
    n = qw.shape[contract[0]]
    return rows if n % rows == 0 and n // rows >= 2 else None


def _piecewise_dot(
    visit: Visit,
    site: Site,
    qw: QWeight,
    x: Any,
    rows: int,
    int_sums: bool | None = None,
) -> jax.Array:
    """``dot_general(x, dequantized weight)`` as a loop over pieces of ``rows`` contracted rows,
    each dequantized (unpacked, converted, scaled) in cache and multiplied into an f32 sum; with
    ``int_sums`` set, the codes themselves in f32 (exact integer sums, see :func:`_int_dot`),
    each piece's added in int32 where ``int_sums`` is True (the whole may pass 2**24). A
    weight converted whole is written out and read back on every call: two weight-only
    2048 -> 8192 -> 2048 blocks at batch 1 ran at 0.39x float's speed that way, 1.26x in pieces
    of 128 rows (jax 0.12; the table in docs/quantize.md)."""
    wi = site.weight_index
    dn = visit.params["dimension_numbers"]
    (lc, rc), _ = dn
    k, ka = (lc, rc)[wi][0], (lc, rc)[1 - wi][0]
    n = qw.shape[k]
    w_dtype = shaped_aval(visit.eqn.invars[wi]).dtype
    # int4 bytes are read in pieces where a piece of them holds whole rows: packed along
    # another axis, or along the rows with pieces of rows i.. and n/2 + i.. in two loop turns at
    # least (a loop of one turn is unrolled, and XLA then converts every layer's weight first)
    p = None if qw.packed is None else pack_axis(qw.shape)
    halves = p == k and (n // 2) % rows == 0 and n // (2 * rows) >= 2
    if p is None or (p == k and not halves):
        src, p = weight_codes(qw, x), None  # (int8 codes; int4 ones unpacked once x is known)
    else:
        src = _in_turn(x, qw.packed) if current_tuning().weights_in_turn else qw.packed
    g = site.weights.group_size if site.weights.granularity == "group" else None
    scale, zp = qw.scale, (qw.zero_point if _nonzero(qw.zero_point) else None)
    if g is not None:  # [channels, groups] -> groups along the weight's contracted axis
        along = lambda v: jnp.asarray(v).T if k == 0 else jnp.asarray(v)
        scale = along(qw.group_scale)
        zp = None if zp is None else along(qw.group_zero_point)

    def piece_of(v: Any, start: Any) -> Any:  # a scale / zero point -> the piece's
        if g is None:
            return v
        return jnp.repeat(lax.dynamic_slice_in_dim(v, start // g, rows // g, k), g, k)

    def dot(q: Any, start: Any) -> jax.Array:  # codes of rows start.. -> their product
        w = q.astype(jnp.float32)
        if int_sums is None:
            if zp is not None:
                w = w - piece_of(zp, start)
            w = (w * piece_of(scale, start)).astype(w_dtype)
        xs = lax.dynamic_slice_in_dim(x, start, rows, ka)
        lhs, rhs = (xs, w) if wi == 1 else (w, xs)
        y = lax.dot_general(lhs, rhs, dn, preferred_element_type=jnp.float32)
        return y.astype(jnp.int32) if int_sums else y

    out = jnp.zeros(shaped_aval(visit.eqn.outvars[0]).shape, jnp.int32 if int_sums else jnp.float32)
    if halves:

        def body(i: Any, acc: jax.Array) -> jax.Array:
            lo, hi = nibbles(lax.dynamic_slice_in_dim(src, i * rows, rows, k))
            return acc + dot(lo, i * rows) + dot(hi, n // 2 + i * rows)

        return lax.fori_loop(0, n // (2 * rows), body, out)

    def piece(i: Any, acc: jax.Array) -> jax.Array:
        q = lax.dynamic_slice_in_dim(src, i * rows, rows, k)
        if p is not None:  # packed along another axis: the piece's bytes, unpacked along it
            q = jnp.concatenate(nibbles(q), p)
        return acc + dot(q, i * rows)

    return lax.fori_loop(0, n // rows, piece, out)


def _weight_only(visit: Visit, site: Site, qw: QWeight, invals: list[Any]) -> jax.Array:
    """A float dot / convolution on the stored codes. Matmuls whose output is smaller than their
    weight (few rows) dequantize it a piece at a time (:func:`_piecewise_dot`), or where that
    does not apply, a symmetric per-tensor or per-channel scale multiplies the output instead,
    so the weight's only per-call work is one fused unpack-and-convert; otherwise (a
    convolution's kernel is small) the weight is dequantized as simulated."""
    wi = site.weight_index
    new = list(invals)
    symmetric = not _nonzero(qw.zero_point) and site.weights.granularity != "group"
    out_size = shaped_aval(visit.eqn.outvars[0]).size  # (symbolic under a polymorphic export:
    out_smaller = isinstance(out_size, int) and out_size < qw.codes.size  # any size, so large)
    pieces = _pieces(visit, site, qw) is not None
    if pieces or not (symmetric and out_smaller) or site.primitive not in QUANTIZABLE:
        return _dequantized_op(visit, site, qw, invals)
    new[wi] = weight_codes(qw, invals[1 - wi]).astype(shaped_aval(visit.eqn.invars[wi]).dtype)
    y = visit.bind(*new).astype(jnp.float32)
    scale = qw.scale
    if scale.size == 1:
        return y * scale.reshape(())
    if site.primitive == "dot_general":
        dn = visit.params["dimension_numbers"]
        ranks = (
            len(shaped_aval(visit.eqn.invars[0]).shape),
            len(shaped_aval(visit.eqn.invars[1]).shape),
        )
        return y * dot_to_out(scale, wi, dn, ranks)
    shape = [1] * y.ndim
    shape[visit.params["dimension_numbers"].out_spec[1]] = -1
    return y * scale.reshape(shape)


def _fill(visit: Visit, value: Any) -> dict[str, Any]:
    """The ``fill_value`` param of a gather of another dtype: ``value`` where the gather fills
    (``mode="fill"``), none to change otherwise."""
    return {"fill_value": value} if _fills(visit) else {}


def _fills(visit: Visit) -> bool:
    return bool(visit.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP)


def _gather_codes(visit: Visit, qw: QWeight, idx: jax.Array, k: int) -> jax.Array:
    """The int8 codes of the rows the gather selects. Int4 tables are gathered packed where the
    packing allows (the rows' bytes, then their nibbles), so no call unpacks the whole table:
    packed along another axis, the gathered bytes are unpacked along it; packed along the rows
    (row ``r`` and row ``r + V/2`` share bytes), the indices are folded into the first half and
    the nibble is chosen per index (out-of-range indices stay out of range, or clamp to the
    same row, in every mode)."""
    codes, shape = qw.codes, tuple(qw.codes.shape)
    packed = qw.packed
    if qw.bits <= 4 and packed is None and _host(codes):
        packed = jnp.asarray(pack_int4(codes))
    axis = pack_axis(shape)
    if qw.bits > 4 or packed is None or axis is None:  # int8 codes (or the unpacked view)
        return visit.bind(weight_codes(qw), idx, **_fill(visit, 0))
    dn = visit.params["dimension_numbers"]
    if axis != k:
        sizes = list(visit.params["slice_sizes"])
        sizes[axis] //= 2
        b = visit.bind(packed, idx, slice_sizes=tuple(sizes), **_fill(visit, 0))
        kept = [d for d in range(len(shape)) if d not in dn.collapsed_slice_dims]
        out_axis = dn.offset_dims[kept.index(axis)]
        return jnp.concatenate(nibbles(b), axis=out_axis)
    half = shape[k] // 2
    pos = dn.start_index_map.index(k)  # (the row's component of each index vector)
    high = idx[..., pos] >= half
    folded = idx.at[..., pos].add(jnp.where(high, -half, 0).astype(idx.dtype))
    b = visit.bind(packed, folded, **_fill(visit, 0))
    lo, hi = nibbles(b)
    sel = jnp.expand_dims(high, tuple(dn.offset_dims))  # [batch..] -> the output's rank
    return jnp.where(sel, hi, lo)


def _gather_rows(visit: Visit, site: Site, qw: QWeight, invals: list[Any]) -> jax.Array:
    """An embedding lookup on the stored codes: the gathered rows' codes, times their scales
    (less their zero points) gathered with the same indices and mode; the table is never
    dequantized as a whole. Where the float gather fills (out-of-range indices under
    ``mode="fill"``), the scale gather fills NaN, and any other fill value is put back."""
    idx = invals[1]
    p = visit.params
    k = site.channel_axis  # (the table axis the gather selects rows along)
    shape = tuple(qw.codes.shape)
    ones = (1,) * len(shape)
    row = tuple(n if d == k else 1 for d, n in enumerate(shape))

    def per_row(v: Any, dtype: Any, fill: Any) -> jax.Array:  # one per row, gathered like codes
        v = jnp.asarray(v, dtype)
        table = jnp.broadcast_to(v.reshape(ones) if v.ndim == 0 else v, row)
        return visit.bind(table, idx, slice_sizes=ones, **_fill(visit, fill))

    q = _gather_codes(visit, qw, idx, k).astype(jnp.float32)
    scale = per_row(qw.scale, jnp.float32, np.float32(np.nan))  # NaN where the gather fills
    if _nonzero(qw.zero_point):
        q = q - per_row(qw.zero_point, jnp.int32, 0).astype(jnp.float32)
    y = q * scale  # (q - zp) * s, as simulated
    fill = p.get("fill_value")
    if _fills(visit) and fill is not None and fill == fill:  # a fill value other than NaN
        y = jnp.where(jnp.isnan(scale), jnp.float32(fill), y)
    return y


def _swapped(visit: Visit) -> tuple[Any, list[int]]:
    """For ``dot_general(w, x)`` with no batch axes, whose output is ``[w free..., x free...]``:
    the dimension numbers of ``dot_general(x, w)`` and the permutation that takes its output to
    that. XLA:CPU's int8 kernel runs
    ``x @ w`` about twice as fast as ``w @ x`` (jax 0.12: 0.55 against 1.17 ms for [1024, 256]
    weights and 512 rows; 0.10.2: 1.15 against 1.73), and the epilogue computed in that layout
    keeps the one transpose at the end, which cancels against the model's own (``vmap`` of
    ``w @ x`` transposes back)."""
    (lc, rc), _ = visit.params["dimension_numbers"]
    w_rank, x_rank = (len(shaped_aval(v).shape) for v in visit.eqn.invars)
    nw, nx = w_rank - len(lc), x_rank - len(rc)
    return ((rc, lc), ((), ())), [*range(nx, nx + nw), *range(nx)]


def realize_handler(state: QState) -> SiteHandler:
    config = state.config
    pooled = pooled_outputs(state.source)

    def handle(visit: Visit, site: Site, qw: QWeight, invals: list[Any], act: Any) -> Any:
        _check_bits(site)
        out_dtype = shaped_aval(visit.eqn.outvars[0]).dtype
        if site.primitive in EMBEDDING:
            return _gather_rows(visit, site, qw, invals).astype(out_dtype)
        wi = site.weight_index
        scheme = site.activations
        if scheme is None:
            return _weight_only(visit, site, qw, invals).astype(out_dtype)
        a = invals[1 - wi]
        _check_static_act(state, site, act, "realize")
        sa, za = act if act is not None else act_qparams(a, scheme, site, None)
        # (bounded with the calibrated zero points, also where the program reads them as values)
        zps: set[int | None] = {state.act[k].zero_point for k in site.act_keys() if k in state.act}
        bound = max(_check_overflow(site, qw, scheme, z) for z in zps or {None})
        if site.weights.granularity == "group":
            y = _dequantized_dot(visit, site, qw, invals, sa, za)
            bad = nonfinite_rows(visit, site, a) if config.nan_rows else None
            return poison_rows(y, bad).astype(out_dtype)
        swap = None
        if site.primitive == "dot_general":
            if wi == 0 and not visit.params["dimension_numbers"][1][0]:  # w @ x: as x @ w
                dn, swap = _swapped(visit)
                acc, scale, nan_rows = _int_dot(
                    visit, dataclasses.replace(site, weight_index=1), qw, a, sa, za,
                    bound, config.nan_rows, dn=dn,
                )  # fmt: skip
            else:
                acc, scale, nan_rows = _int_dot(visit, site, qw, a, sa, za, bound, config.nan_rows)
        else:
            acc, scale = _int_conv(visit, site, qw, a, sa, za, bound < 2**24, site.name in pooled)
            nan_rows = False
        # (fixed-point requantization goes through int32, which drops a NaN the sums carry)
        native = nan_rows and config.requantize == "float"
        bad = None if native or not config.nan_rows else nonfinite_rows(visit, site, a)
        if swap is not None and bad is not None and bad.ndim:
            bad = jnp.transpose(bad, [int(d) for d in np.argsort(swap)])
        out = state.act.get(site.name + ":out")
        if config.requantize == "fixed_point":
            if out is None:
                raise QuantizeError(
                    f"realize: requantize='fixed_point' needs the output scale of {site.name!r}; "
                    "calibrate the program annotated with this config first"
                )
            if not _host(scale):
                raise QuantizeError(
                    f"realize: requantize='fixed_point' computes each layer's integer multipliers "
                    f"on the host from its weight scales, but the weight of {site.name!r} is a "
                    "param (an input). Quantize with the weights closed over "
                    "(jaxq.quantize(functools.partial(f, params), ...)), or use "
                    "requantize='float'."
                )
            off = storage_offset(scheme)
            qmin, qmax = scheme.qrange
            mult = np.asarray(scale, np.float64) / np.float64(out.scale)
            m, e = F.quantize_multipliers(mult)
            zo = out.zero_point + off
            acc = acc.astype(jnp.int32)  # exact: integer-valued (the f32-carried path)
            q = F.requantize(acc, jnp.asarray(m), jnp.asarray(e), zo, qmin + off, qmax + off)
            q = q.astype(jnp.int8)
            y = (q.astype(jnp.int32) - zo).astype(jnp.float32) * jnp.float32(out.scale)
        else:
            y = acc.astype(jnp.float32) * scale
        # codes cannot hold NaN or Inf: the rows that had them come out NaN, as simulated
        y = poison_rows(y, bad)
        return (y if swap is None else jnp.transpose(y, swap)).astype(out_dtype)

    return handle


def realize_program(program: Program, config: QConfig | None = None) -> Program:
    state = get_state(program, "realize")
    current_tuning()  # a bad PassContext entry fails here, not inside the first layer
    if config is not None and config != state.config:
        raise QuantizeError(
            "realize: config differs from the one the program was annotated with; annotate "
            "(and calibrate) again with the new config"
        )
    method = state.config.weight_calibration
    if method in ("gptq", "awq") and state.calibration.get("weights") != method:
        raise QuantizeError(
            f"realize: weight_calibration={method!r} chooses weight codes from calibration data; "
            "run jaxq.quantize.calibrate(data) before realize"
        )
    state = state.replace(mode="realize", source=float_source(program, state, "realize"))
    out, engine = lower(state, realize_handler(state), mode="realize", integer_chains=True)
    check_sites(state, engine, "realize")
    state = state.replace(weights=engine.weights, output=out.jaxpr)
    return with_state(out, state)


def realize(config: QConfig | None = None) -> Pass:
    """A pass that lowers an annotated (and calibrated) program to integer code: int8 weights
    stored once, int8 x int8 -> int32 dots and convolutions, and float or fixed-point
    requantization. ``config`` (optional) must be the one the program was annotated with."""
    if config is not None and not isinstance(config, QConfig):
        raise TypeError(f"realize: config must be a jaxq.QConfig; got {type(config).__name__}")

    @program_pass(name="quantize.realize")
    def run(program: Program) -> Program:
        return realize_program(program, config)

    return run
