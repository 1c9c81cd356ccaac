"""Weights as parameters: which param leaf feeds which layer, and the quantized-params pytree.

``jaxq.quantize(f, params, ...)`` traces ``f(params, *args)`` with the params as inputs. While a
phase re-traces the program, each param leaf enters as a :class:`WeightRef`: the value (a float
array, or in realize a :class:`QView` of the ``QArray`` that replaced it) and the chain of
layout-only equations (convert, transpose, copy) it went through. A quantizable equation that
receives one is a site whose weight is that leaf; any other equation gets the float value
(``to_float``). The leaf is quantized on the host, leaf by leaf, by :func:`quantize_leaf`, with the
site's geometry mapped back through the chain, so the codes keep the user's layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxq.quantize._config import Scheme
from jaxq.quantize._qarray import (
    FIELDS,
    QArray,
    nibbles,
    pack_axis,
    pack_int4,
    packed_shape,
    unpack_int4,
)

CHAIN = (
    "convert_element_type",
    "transpose",
    "rev",
    "copy",
    "copy_p",
    "stop_gradient",
    "sharding_constraint",
    "device_put",
    "optimization_barrier",
    "name",
)
"""Equations a weight may pass through between its param leaf and its layer (``rev``: the
flipped kernel of a ``ConvTranspose(transpose_kernel=True)``; the last five keep the value:
a frozen layer, ``with_sharding_constraint``, ``device_put``, a barrier, ``checkpoint_name``).
Realize drops the last four on the codes (the quantized params carry their own shardings)."""


@dataclasses.dataclass(frozen=True)
class QView:
    """A QArray seen inside a traced program: unpacked int8 codes, and scale / zero point with the
    codes' rank (groups repeated out only where needed), in the orientation of the current use."""

    codes: Any
    scale: Any
    zero_point: Any  # None when symmetric
    dtype: Any
    group_axis: int | None = None
    group_size: int | None = None
    sums: Any = None  # the codes' sums over the contracted axes (kept), or None
    packed: Any = None  # the stored int4 bytes while in the QArray's own orientation, or None
    act_scale: Any = None  # the calibrated activation scale the QArray carries, or None
    act_zero_point: Any = None

    @classmethod
    def of(cls, qa: QArray) -> QView:
        rank = lambda v: (
            None if v is None else jnp.reshape(v, np.shape(v) + (1,) * (qa.ndim - np.ndim(v)))
        )
        scale = rank(qa.scale) if np.ndim(qa.scale) else jnp.reshape(qa.scale, (1,) * qa.ndim)
        zp = qa.zero_point
        zp = None if zp is None else (rank(zp) if np.ndim(zp) else jnp.reshape(zp, (1,) * qa.ndim))
        packed = qa.codes if qa.bits <= 4 else None
        return cls(
            qa.int_codes(),
            scale,
            zp,
            qa.dtype,
            qa.group_axis,
            qa.group_size,
            qa.sums,
            packed,
            qa.act_scale,
            qa.act_zero_point,
        )

    def arrays(self) -> dict[str, Any]:
        """The view's arrays by field (None where absent): what a scan slices per iteration.
        Int4 codes stay packed, so the loop holds one layer unpacked at a time, not the stack:
        packed along another axis, the scan slices the bytes; packed along the stack axis
        (even layer count), :meth:`layer` reads its layer's bytes from :attr:`packed`."""
        arrays = {k: getattr(self, k) for k in FIELDS}
        axis = self._pack_axis()
        if axis is not None:
            arrays["codes"] = self.packed if axis > 0 else None
        return arrays

    def layer(self, arrays: Mapping[str, Any], index: Any) -> QView:
        """The view of layer ``index`` of this stacked view, from its :meth:`arrays` sliced along
        the leading (stack) axis."""
        ga = None if self.group_axis is None else self.group_axis - 1
        codes, axis = arrays["codes"], self._pack_axis()
        shape = np.shape(self.codes)
        if axis == 0:  # layer i is in the low nibbles of byte row i (first half), else the high
            half = shape[0] // 2
            lo, hi = nibbles(lax.dynamic_index_in_dim(self.packed, index % half, 0, False))
            codes = jnp.where(index < half, lo, hi)
        elif axis is not None:
            codes = unpack_int4(codes, shape[1:])
        return dataclasses.replace(self, **{**arrays, "codes": codes}, group_axis=ga, packed=None)

    def _pack_axis(self) -> int | None:
        """The stacked codes' packing axis, or None when they are not packed (or packed flat,
        which a scan cannot slice: then it slices the unpacked codes)."""
        return None if self.packed is None else pack_axis(np.shape(self.codes))

    def full(self, v: Any) -> Any:
        if v is None or self.group_size is None:
            return v
        return jnp.repeat(v, self.group_size, axis=self.group_axis)

    def dequantize(self) -> jax.Array:
        q = self.codes.astype(jnp.float32)
        if self.zero_point is not None:
            q = q - self.full(self.zero_point).astype(jnp.float32)
        return (q * self.full(self.scale)).astype(self.dtype)

    def apply(self, primitive: str, params: Mapping[str, Any]) -> QView:
        if primitive == "transpose":
            perm = tuple(params["permutation"])
            t = lambda v: None if v is None else jnp.transpose(v, perm)
            ga = None if self.group_axis is None else perm.index(self.group_axis)
            return dataclasses.replace(
                self,
                codes=t(self.codes),
                scale=t(self.scale),
                zero_point=t(self.zero_point),
                group_axis=ga,
                sums=t(self.sums),
                packed=None,  # (packed in the leaf's orientation: the unpacked codes serve)
            )
        if primitive == "rev":
            dims = tuple(params["dimensions"])
            f = lambda v: None if v is None else _flip(v, dims)
            return dataclasses.replace(
                self,
                codes=f(self.codes),
                scale=f(self.scale),
                zero_point=f(self.zero_point),
                sums=f(self.sums),
                packed=None,
            )
        if primitive == "convert_element_type":
            return dataclasses.replace(self, dtype=np.dtype(params["new_dtype"]))
        return self  # copy


@dataclasses.dataclass(frozen=True)
class WeightRef:
    """A param leaf (index ``leaf``) after the layout-only equations in ``chain``."""

    leaf: int
    value: Any  # a float array, or a QView
    chain: tuple[tuple[str, Any], ...] = ()
    layers: int = 0  # > 0: ``value`` is one iteration's slice of a stacked leaf of this many

    def then(self, primitive: str, params: Mapping[str, Any], value: Any) -> WeightRef:
        key = tuple(params["permutation"]) if primitive == "transpose" else None
        if primitive == "rev":
            key = tuple(params["dimensions"])
        if primitive == "convert_element_type":
            key = np.dtype(params["new_dtype"]).name
        return WeightRef(self.leaf, value, (*self.chain, (primitive, key)), self.layers)


def to_float(v: Any) -> Any:
    """The float value of a weight reference (anything else unchanged)."""
    if isinstance(v, WeightRef):
        return v.value.dequantize() if isinstance(v.value, QView) else v.value
    return v


def leaf_axis(chain: Sequence[tuple[str, Any]], axis: int) -> int:
    """The leaf's axis that becomes ``axis`` after ``chain``."""
    for prim, key in reversed(chain):
        if prim == "transpose":
            axis = key[axis]
    return axis


def to_site(w: Any, chain: Sequence[tuple[str, Any]]) -> Any:
    """A leaf's value (on the host, or traced) in the orientation and dtype its layer sees."""
    for prim, key in chain:
        if prim == "transpose":
            w = np.transpose(w, key)
        elif prim == "rev":
            w = _flip(w, key)
        elif prim == "convert_element_type":
            w = w.astype(key)
    return w


def _flip(v: Any, dims: tuple[int, ...]) -> Any:
    """``v`` reversed along ``dims`` (those of size 1 in a broadcastable scale: as they are)."""
    xp = np if isinstance(v, (np.ndarray, np.generic)) else jnp
    return xp.flip(v, tuple(d for d in dims if np.shape(v)[d] > 1))


def to_leaf(v: Any, chain: Sequence[tuple[str, Any]]) -> Any:
    """Inverse of :func:`to_site` for the layout (a site-oriented array back to the leaf's)."""
    for prim, key in reversed(chain):
        if prim == "transpose" and np.ndim(v) == len(key):  # (a per-tensor scale: as it is)
            v = np.transpose(v, np.argsort(key))
        elif prim == "rev" and np.ndim(v):
            v = _flip(v, key)
    return v


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one param leaf is quantized: for the layer ``site``, through ``chain``."""

    leaf: int
    path: str
    site: str
    chain: tuple[tuple[str, Any], ...]
    scheme: Scheme
    scale_axes: tuple[int, ...]  # ``Site.scale_axes`` in the leaf's orientation
    group_axis: int | None  # in the leaf's orientation (granularity="group")
    shape: tuple[int, ...]
    dtype: str
    sum_axes: tuple[int, ...] | None = None  # leaf axes the stored code sums run over, if any
    # the layer whose calibrated activation scale (and zero point, where ``act_asymmetric``) the
    # QArray carries as inputs of the program, or None (see ``QArray.act_scale``)
    act_site: str | None = None
    act_asymmetric: bool = False
    # > 0: a stacked leaf ``[layers, ...]`` whose slices are the weights of a scanned layer; the
    # axes above and ``scale_shape`` / ``sums_shape`` are those of one slice
    layers: int = 0

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """The shape of the weight of one layer (a slice of a stacked leaf)."""
        return self.shape[1:] if self.layers else self.shape

    def _stack(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A per-layer array shape as stored in a stacked QArray (leading axis: the layers; a
        per-tensor value keeps the weight's rank, so it broadcasts against the codes)."""
        if not self.layers:
            return shape
        return (self.layers, *(shape or (1,) * len(self.layer_shape)))

    def sums_shape(self) -> tuple[int, ...]:
        assert self.sum_axes is not None  # (only asked of plans that store sums)
        return tuple(1 if d in self.sum_axes else n for d, n in enumerate(self.layer_shape))

    def scale_shape(self) -> tuple[int, ...]:
        s = self.scheme
        if s.granularity == "tensor":
            return ()
        layer = self.layer_shape
        shape = [n if d in self.scale_axes else 1 for d, n in enumerate(layer)]
        if self.group_axis is not None:
            assert s.group_size is not None  # granularity="group" requires it
            shape[self.group_axis] = layer[self.group_axis] // s.group_size
        return tuple(shape)

    def spec(self) -> QArray:
        """The QArray's abstract value (``jax.ShapeDtypeStruct`` leaves), for tracing."""
        s = self.scheme
        codes = packed_shape(self.shape) if s.bits <= 4 else self.shape
        sds = jax.ShapeDtypeStruct
        scale = self._stack(self.scale_shape())
        act = (self.layers,) if self.layers else ()
        sums = None if self.sum_axes is None else sds(self._stack(self.sums_shape()), np.int32)
        return self.qarray(
            sds(codes, np.int8),
            sds(scale, np.float32),
            sds(scale, np.int32),
            sums,
            sds(act, np.float32),
            sds(act, np.int32),
        )

    def qarray(
        self, codes: Any, scale: Any, zero_point: Any, sums: Any, act_scale: Any, act_zp: Any
    ) -> QArray:
        """The QArray of these arrays with this plan's metadata, keeping only those the plan
        stores (no zero point for a signed symmetric scheme, no activation scale without
        ``act_site``...)."""
        s = self.scheme
        has_act = self.act_site is not None
        return QArray(
            codes,
            scale,
            None if s.symmetric and s.signed else zero_point,  # (unsigned: stored shifted)
            None if self.sum_axes is None else sums,
            act_scale if has_act else None,
            act_zp if has_act and self.act_asymmetric else None,
            shape=self.shape,
            dtype=self.dtype,
            bits=s.bits,
            group_axis=self._axis(self.group_axis),
            group_size=s.group_size,
            layers=self.layers,
        )

    def _axis(self, axis: int | None) -> int | None:
        """A per-layer axis as an axis of the stacked leaf."""
        return axis if axis is None or not self.layers else axis + 1


def to_qarray(
    plan: LeafPlan,
    codes: np.ndarray,
    scale: np.ndarray,
    zp: np.ndarray,
    group_scale: Any,
    group_zp: Any,
    channel_axis: int,
    act: Any = None,
) -> QArray:
    """A site-oriented quantized weight (``QWeight`` fields) as a QArray in the leaf's layout;
    ``act``: the ``ActParams`` of ``plan.act_site``."""
    s = plan.scheme
    codes = to_leaf(np.asarray(codes, np.int8), plan.chain)
    if group_scale is not None:  # [N, G] -> site layout (channel axis N, contracted axis G)
        gs, gz = np.asarray(group_scale, np.float32), np.asarray(group_zp, np.int32)
        if channel_axis == 1:
            gs, gz = gs.T, gz.T
        scale, zp = to_leaf(gs, plan.chain), to_leaf(gz, plan.chain)
    else:
        scale = to_leaf(np.asarray(scale, np.float32), plan.chain).reshape(plan.scale_shape())
        zp = to_leaf(np.asarray(zp, np.int32), plan.chain).reshape(plan.scale_shape())
    sums = None
    if plan.sum_axes is not None:
        sums = codes.astype(np.int64).sum(axis=plan.sum_axes, keepdims=True).astype(np.int32)
    if act is None:
        plan = dataclasses.replace(plan, act_site=None)
    # (jax.device_put: jnp.asarray of a host array compiles a copy for every new shape, about
    # 20 ms each, four per weight)
    return plan.qarray(
        jax.device_put(pack_int4(codes) if s.bits <= 4 else codes),
        jax.device_put(scale),
        jax.device_put(zp),
        None if sums is None else jax.device_put(sums),
        None if act is None else jax.device_put(np.float32(act.scale)),
        None if act is None else jax.device_put(np.int32(act.zero_point)),
    )


def stack_qarrays(plan: LeafPlan, layers: Sequence[QArray], acts: Sequence[Any]) -> QArray:
    """The QArray of a stacked leaf from its layers' QArrays (quantized one by one, each with
    scales of its own) and each layer's ``ActParams`` (for ``plan.act_site``; none without)."""
    stack = lambda vs: None if vs[0] is None else np.stack([np.asarray(v) for v in vs])
    codes = np.stack([np.asarray(q.int_codes()) for q in layers])
    per_layer = lambda v: (
        None if v is None else jax.device_put(v.reshape(plan._stack(plan.scale_shape())))
    )
    sums = stack([q.sums for q in layers])
    return plan.qarray(
        jax.device_put(pack_int4(codes) if plan.scheme.bits <= 4 else codes),
        per_layer(stack([q.scale for q in layers])),
        per_layer(stack([q.zero_point for q in layers])),
        None if sums is None else jax.device_put(sums),
        jax.device_put(np.asarray([a.scale for a in acts], np.float32)) if acts else None,
        jax.device_put(np.asarray([a.zero_point for a in acts], np.int32)) if acts else None,
    )


def chain_value(value: Any, primitive: str, params: Mapping[str, Any], bind: Any) -> Any:
    """Apply one chain equation to a weight value (float: re-bind it; QView: its own rule)."""
    if isinstance(value, QView):
        return value.apply(primitive, params)
    return bind(value)


def float_leaf(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
