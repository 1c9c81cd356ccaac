"""The quantize arithmetic: scales from ranges, codes, weight quantization and fake quantization,
all with ``simulated_quantize``'s operations, so the host, the simulated program and the
realized program compute the same codes."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxq import _warnings
from jaxq.annotate._simulated_quantize import _ROUND, simulated_quantize_p
from jaxq.quantize._config import Scheme
from jaxq.quantize._gptq import gptq_codes
from jaxq.quantize._params import (
    QView,
)
from jaxq.quantize._state import (
    ActParams,
    QParam,
    QuantizeError,
    QWeight,
    Site,
    is_concrete,
)

# ---- scales -------------------------------------------------------------------------------------


def range_to_qparams(lo: Any, hi: Any, scheme: Scheme) -> tuple[jax.Array, jax.Array]:
    """Scale and zero point (float32, scheme's code range) covering ``[lo, hi]`` (and 0)."""
    qmin, qmax = scheme.qrange
    lo = jnp.minimum(jnp.asarray(lo, jnp.float32), 0.0)
    hi = jnp.maximum(jnp.asarray(hi, jnp.float32), 0.0)
    # (times the float32 reciprocal of the code span: XLA compiles a division by a constant
    # that way, so the host, an eager call and a compiled program get the same scale)
    if scheme.symmetric:
        if scheme.signed:
            scale = jnp.maximum(-lo, hi) * reciprocal(2 ** (scheme.bits - 1) - 1)
        else:
            scale = hi * reciprocal(qmax)
    else:
        r = reciprocal(qmax - qmin)
        # (a span beyond float32's largest, e.g. [-2e38, 2e38]: each end scaled first)
        scale = jnp.where(jnp.isfinite(hi - lo), (hi - lo) * r, hi * r - lo * r)
    # (a range so small that its scale is subnormal, which XLA:CPU flushes to 0, takes the least
    # normal scale: its codes are coarser, not all 0; an empty range or a non-finite one takes 1)
    live = (hi > lo) & jnp.isfinite(scale)
    scale = jnp.where(live, jnp.maximum(scale, np.float32(np.finfo(np.float32).tiny)), 1.0)
    if scheme.symmetric:  # (not zeros_like: a constant, which the host path would compile alone)
        zp = scale * np.float32(0)
    else:
        zp = jnp.clip(jnp.round(qmin - lo / scale), qmin, qmax)
    return scale, zp


host_range_to_qparams = jax.jit(range_to_qparams, static_argnums=2)
"""``range_to_qparams`` as one compiled function per scheme, for ranges known on the host (an
activation's calibrated range): run op by op, each of its dozen operations compiled on first use,
which took a third of a second of every process's first ``jaxq.quantize``."""


def reciprocal(n: int) -> np.float32:
    """``1 / n`` rounded to float32 once, as XLA folds it."""
    return np.float32(1) / np.float32(n)


def codes(x: jax.Array, scale: QParam, zp: QParam, scheme: Scheme) -> jax.Array:
    """Integer codes, as float32, computed exactly as ``simulated_quantize`` computes them."""
    qmin, qmax = scheme.qrange
    # jnp.clip's nested jit, not an inline clamp: with literal bounds XLA:CPU proved the codes'
    # range and widened a convolution fed by them to s32 x s32, off its int8 kernel (measured:
    # bench_quantize's CNN at batch 256, 79 ms against 7.7 ms)
    # (times the scale's reciprocal, as documented: XLA compiles a division by a constant as
    # that product but divides by a scale given at run time, one code apart at exact ties)
    inverse = 1 / scale
    return jnp.clip(_ROUND[scheme.rounding](x.astype(scale.dtype) * inverse) + zp, qmin, qmax)


@jax.custom_jvp
def straight_through(x: jax.Array, fake: jax.Array) -> jax.Array:
    """``fake`` (``x`` fake-quantized), whose derivative in ``x`` is 1: the straight-through
    estimator, for codes computed with ``codes`` (``jnp.round`` has derivative 0)."""
    return fake


@straight_through.defjvp
def _straight_through_jvp(primals: Any, tangents: Any) -> tuple[jax.Array, jax.Array]:
    return primals[1], tangents[0].astype(primals[1].dtype)


INT8_VIA_INT32_MIN = 2**16
"""Tensors at least this large reach int8 through int32 (see ``int8_codes``)."""


def int8_codes(q: jax.Array) -> jax.Array:
    """Float codes (integers in the int8 range) as int8. A large tensor converts through int32:
    XLA:CPU's YNN fusion would otherwise pull a direct f32 -> s8 convert into the next kernel,
    and the loop fusion before it would write the codes as f32 (4x the bytes; measured 20-25%
    faster for a requantize feeding a pooled int8 matmul at batch 256). A small one converts
    directly: there the convert inside the kernel is cheaper (measured at batch 1). A symbolic
    size (a shape-polymorphic batch) counts as large."""
    if not isinstance(q.size, int) or q.size >= INT8_VIA_INT32_MIN:
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

    def error(r: Any) -> jax.Array:
        scale, zp = range_to_qparams(lo * r, hi * r, s)
        q = jnp.clip(_ROUND[s.rounding](wf / scale) + zp, qmin, qmax)  # the scheme's rounding
        return jnp.sum(jnp.square((q - zp) * scale - wf), axes, keepdims=True)

    ratios = jnp.asarray(MSE_RATIOS[1:], jnp.float32)

    def step(i: Any, best: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        err = error(ratios[i])
        return jnp.minimum(err, best[0]), jnp.where(err < best[0], ratios[i], best[1])

    # (a loop, not 25 copies of the search: one small program to compile per weight shape)
    _, best_r = lax.fori_loop(0, len(ratios), step, (error(1.0), jnp.ones_like(lo)))
    return lo * best_r, hi * best_r


def weight_qparams(
    wf: jax.Array, s: Scheme, scale_axes: tuple[int, ...], method: str
) -> tuple[Any, Any, Any, Any]:
    """``(scale, zero_point, group_scale, group_zero_point)`` of a float32 weight with one scale
    per index of ``scale_axes`` (``Site.scale_axes``: a dot's weight axes but the contracted
    ones), per group or per tensor: scale and zero point broadcastable to it (full size for
    groups), the group ones ``[channels, groups]`` (None unless grouped). Core ops only, so the
    same arithmetic runs on the host (``quantize_weight``) and inside a program (QAT)."""
    if s.granularity in ("tensor", "channel"):
        n = math.prod(wf.shape[d] for d in scale_axes)
        kept = tuple(range(-len(scale_axes), 0))
        wc = jnp.moveaxis(wf, scale_axes, kept).reshape(-1, n)
        axes = (0, 1) if s.granularity == "tensor" else (0,)
        lo, hi = _weight_ranges(wc, axes, s, method)
        scale, zp = range_to_qparams(lo, hi, s)
        if s.granularity == "channel":  # [1, N] -> broadcastable to the weight
            shape = [wf.shape[d] if d in scale_axes else 1 for d in range(wf.ndim)]
            return scale.reshape(shape), zp.reshape(shape), None, None
        return scale.reshape(()), zp.reshape(()), None, None
    # group: a 2-D weight, groups along the contracted axis, per channel
    (channel_axis,) = scale_axes
    wt = jnp.moveaxis(wf, channel_axis, 0)  # [N, K]
    n, kk = wt.shape
    g = s.group_size
    assert g is not None  # Scheme requires group_size with granularity="group"
    lo, hi = _weight_ranges(wt.reshape(n, kk // g, g), (2,), s, method)
    group_scale, group_zp = range_to_qparams(lo[..., 0], hi[..., 0], s)
    full_scale = jnp.moveaxis(jnp.repeat(group_scale, g, axis=1), 0, channel_axis)
    full_zp = jnp.moveaxis(jnp.repeat(group_zp, g, axis=1), 0, channel_axis)
    return full_scale, full_zp, group_scale, group_zp


def traced_qweight(w: jax.Array, site: Site, method: str) -> QWeight:
    """A weight's scales computed inside the program from its current value (params in simulate
    mode: QAT moves the weights, and the scales follow). No codes: the simulated program
    fake-quantizes the weight itself. ``"gptq"`` needs data, so it uses minmax scales here."""
    wf = lax.stop_gradient(w.astype(jnp.float32))
    scale, zp, gs, gz = weight_qparams(
        wf, site.weights, site.scale_axes, "mse" if method == "mse" else "minmax"
    )
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
        sums=view.sums,
        packed=view.packed,
    )


_host_weight_qparams = jax.jit(weight_qparams, static_argnums=(1, 2, 3))
"""``weight_qparams`` as one compiled function per weight shape and scheme: run op by op, each
of its operations compiled for every new weight shape (26 clipping ratios for MSE), which made
quantizing a model of many shapes take seconds per weight."""


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
        wf = np.asarray(w).astype(np.float32, copy=False)  # (on the host: checks compile nothing)
        if not np.isfinite(wf).all():
            raise QuantizeError(f"quantize: weight of {site.name!r} holds NaN or Inf")
        if s.symmetric and not s.signed and (wf < 0).any():
            _warnings.warn(
                f"quantize: the weight of {site.name!r} holds negative values, which an unsigned "
                "symmetric scheme (codes from 0, zero point 0) clips to 0; use "
                "Scheme(signed=True) or Scheme(symmetric=False) for it",
                UserWarning,
            )
        how = "mse" if method == "mse" else "minmax"  # (GPTQ and AWQ start from minmax scales)
        full_scale, full_zp, group_scale, group_zp = _host_weight_qparams(
            wf, s, site.scale_axes, how
        )
        off = storage_offset(s)
        scales = QWeight(
            codes=np.zeros(wf.shape, np.int8),
            scale=np.asarray(full_scale, np.float32),
            zero_point=(np.asarray(full_zp) + off).astype(np.int32),
            offset=off,
            bits=s.bits,
            group_scale=None if group_scale is None else np.asarray(group_scale, np.float32),
            group_zero_point=None
            if group_zp is None
            else (np.asarray(group_zp) + off).astype(np.int32),
            method=how,
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
        fq = np.asarray(fake_quant_weight(wf, scales, site), np.float64)
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
        # the other scale axes first: the primitive's scale runs along its leading axes and one
        # more (``axis``), as its vmap rule writes it
        extra = site.extra_scale_axes
        front = tuple(range(len(extra)))
        w = xp.moveaxis(w, extra, front)
        c = len(extra) + [d for d in range(w.ndim) if d not in extra].index(site.channel_axis)
        vec = lambda v: xp.moveaxis(v, extra, front).reshape((*w.shape[: len(extra)], -1))
        y = simulated_quantize_p.bind(w, vec(qw.scale), vec(zp), axis=c, group_size=None, **params)
        return _moveaxis(y, front, extra)
    # group: channel axis moved to the front, so the [N, G] scale's leading dim lines up with it
    wt = xp.moveaxis(w, site.channel_axis, 0)
    assert qw.group_zero_point is not None  # quantize_weight sets it for granularity="group"
    gzp = (qw.group_zero_point - qw.offset).astype(np.float32)
    y = simulated_quantize_p.bind(
        wt, qw.group_scale, gzp, axis=1, group_size=s.group_size, **params
    )
    return _moveaxis(y, 0, site.channel_axis)


def _moveaxis(y: Any, source: Any, destination: Any) -> Any:
    """``moveaxis`` in numpy for a value known on the host (jnp's compiles for every new weight
    shape), in the program for a traced one."""
    if is_concrete(y):
        return np.moveaxis(np.asarray(y), source, destination)
    return jnp.moveaxis(y, source, destination)


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
    if ax is None:  # one scale for all rows: a row holding NaN or Inf must not set it
        row_bad = jnp.any(~jnp.isfinite(xf), axis=site.reduce_axes, keepdims=True)
        xf = jnp.where(row_bad, jnp.float32(0), xf)
    keep = scheme.granularity == "token"
    # (initial 0: the range holds 0 anyway, and an empty batch then has one, not an error)
    hi = jnp.max(jnp.abs(xf) if scheme.symmetric and scheme.signed else xf, ax, None, keep, 0.0)
    if scheme.symmetric:  # one reduction: the scale only needs max|x| (signed) or max(x)
        return range_to_qparams(-hi if scheme.signed else jnp.zeros_like(hi), hi, scheme)
    return range_to_qparams(jnp.min(xf, ax, None, keep, 0.0), hi, scheme)


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
