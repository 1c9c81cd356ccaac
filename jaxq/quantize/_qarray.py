"""``QArray``: a quantized weight as a pytree node, so quantized params are an ordinary pytree.

``jax.tree.map``, ``jax.device_put(qparams, shardings)``, checkpointing and ``jax.jit`` see its
arrays (``codes``, ``scale``, ``zero_point``) as leaves and its layout as static metadata, exactly as
they see the float params it replaces (models: qwix's ``QArray``, AQT's ``QTensor``).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def pack_axis(shape: tuple[int, ...]) -> int | None:
    """The axis int4 codes are packed along (its two halves share bytes): the first of even
    length, so unpacking is one concatenate; None (packed flat, padded) when no axis is even."""
    return next((d for d, n in enumerate(shape) if n % 2 == 0), None)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Signed codes in [-8, 7] -> int8 bytes, two per byte: the first half of the packing axis
    in the low nibbles, the second half in the high nibbles."""
    q = np.asarray(q, np.int8)
    axis = pack_axis(q.shape)
    if axis is None:
        q = np.concatenate([q.reshape(-1), np.zeros(q.size % 2, np.int8)])
        axis = 0
    lo, hi = np.split(q, 2, axis=axis)
    return ((lo.astype(np.uint8) & 0xF) | ((hi.astype(np.uint8) & 0xF) << 4)).view(np.int8)


def unpack_int4(packed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`pack_int4`: two arithmetic shifts (sign extension) and a concatenate,
    which XLA fuses into the consumer's loop."""
    lo, hi = nibbles(packed)
    axis = pack_axis(shape)
    if axis is None:
        return jnp.concatenate([lo, hi])[: math.prod(shape)].reshape(shape)
    return jnp.concatenate([lo, hi], axis=axis)


def nibbles(b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The low and high signed nibbles of int4 bytes (see :func:`pack_int4`)."""
    lo = lax.shift_right_arithmetic(lax.shift_left(b, jnp.int8(4)), jnp.int8(4))
    return lo, lax.shift_right_arithmetic(b, jnp.int8(4))


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the int8 bytes holding int4 codes of ``shape``."""
    axis = pack_axis(shape)
    if axis is None:
        return ((math.prod(shape) + 1) // 2,)
    return tuple(n // 2 if d == axis else n for d, n in enumerate(shape))


FIELDS = ("codes", "scale", "zero_point", "sums", "act_scale", "act_zero_point")
"""A QArray's arrays, in the order of its children."""


@jax.tree_util.register_pytree_with_keys_class
class QArray:
    """A quantized array: ``value = scale * (codes - zero_point)`` in the original ``dtype``.

    Attributes:
      codes: int8 codes of ``shape`` (offset into the signed range), or for ``bits <= 4`` two codes
        per byte (see :func:`pack_int4`).
      scale: float32, broadcastable to ``shape``; with ``group_size`` its ``group_axis`` holds one
        entry per group of ``group_size`` consecutive elements.
      zero_point: int32 like ``scale`` (in code units, offset like the codes), or None (symmetric).
      sums: int32 sums of the codes over the axes the layer contracts (kept as size-1 axes), or
        None. Stored where the layer's activations have a zero point, whose term
        ``zero_point_a * sum(w)`` would otherwise read the whole weight again on every call.
      act_scale: float32 scalar, the calibrated scale of the activations this weight multiplies
        (static activation quantization), or None. Stored here, as an input of the program rather
        than a constant in it, so that layers alike in shape compile to the same code (XLA:CPU
        compiles a stack of such layers several times faster); ``quantize_params`` keeps it.
      act_zero_point: int32 scalar, those activations' zero point (asymmetric schemes), or None.
      shape: the shape of the float array it stands for.
      dtype: the dtype of the float array it stands for (what ``dequantize`` returns).
      bits: code width in bits.
      group_axis: with grouped scales, the axis of ``scale`` that runs over the groups; else None.
      group_size: with grouped scales, how many consecutive elements share a scale; else None.
      layers: for the weights of a layer stack run by ``lax.scan`` (stacked params), the number
        of layers along the leading axis, each with scales of its own; else 0.
    """

    codes: Any
    scale: Any
    zero_point: Any
    sums: Any
    act_scale: Any
    act_zero_point: Any
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    bits: int
    group_axis: int | None
    group_size: int | None
    layers: int
    _keyed: tuple[tuple[str, Any], ...]
    _leaves: tuple[Any, ...]
    _aux: tuple[Any, ...]

    def __init__(
        self,
        codes: Any,
        scale: Any,
        zero_point: Any = None,
        sums: Any = None,
        act_scale: Any = None,
        act_zero_point: Any = None,
        *,
        shape: tuple[int, ...],
        dtype: Any,
        bits: int = 8,
        group_axis: int | None = None,
        group_size: int | None = None,
        layers: int = 0,
    ) -> None:
        arrays = dict(
            zip(FIELDS, (codes, scale, zero_point, sums, act_scale, act_zero_point), strict=True)
        )
        set_ = object.__setattr__  # (immutable: flattening reuses what is computed here)
        for k, v in arrays.items():
            set_(self, k, v)
        set_(self, "shape", tuple(int(n) for n in shape))
        set_(self, "dtype", np.dtype(dtype))
        set_(self, "bits", int(bits))
        set_(self, "group_axis", group_axis)
        set_(self, "group_size", group_size)
        set_(self, "layers", int(layers))
        # flattening runs on every call of a jitted function: children and static metadata are
        # computed once
        self._structure(tuple(v is not None for v in arrays.values()))

    def _structure(self, present: tuple[bool, ...]) -> None:
        """Fix which arrays are children (``present``, in field order) and the static metadata."""
        set_ = object.__setattr__
        keyed = tuple((k, getattr(self, k)) for k, p in zip(FIELDS, present, strict=True) if p)
        set_(self, "_keyed", keyed)
        set_(self, "_leaves", tuple(v for _, v in keyed))
        aux = (self.shape, self.dtype.name, self.bits, self.group_axis, self.group_size)
        set_(self, "_aux", (*aux, self.layers, present))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"QArray is immutable (it is a pytree node); make a new one instead of setting "
            f"{name!r}, e.g. jax.tree.map over it"
        )

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(self._not_an_array())

    def __jax_array__(self) -> Any:
        raise TypeError(self._not_an_array())

    def _not_an_array(self) -> str:
        return (
            f"{self!r} is a quantized weight (int codes and scales), not an array: "
            "q.dequantize() gives its float value, and the quantized function takes it as it "
            "is (jax.jit(qf.apply)(qf.params, x))"
        )

    # -- pytree -----------------------------------------------------------------------------------
    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return self._leaves, self._aux

    def tree_flatten_with_keys(self) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        key = jax.tree_util.GetAttrKey
        return [(key(k), v) for k, v in self._keyed], self._aux

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: list[Any]) -> QArray:
        shape, dtype, bits, group_axis, group_size, layers, present = aux
        it = iter(children)
        qa = cls(
            *(next(it) if p else None for p in present),
            shape=shape,
            dtype=dtype,
            bits=bits,
            group_axis=group_axis,
            group_size=group_size,
            layers=layers,
        )
        if qa._aux[-1] != present:  # (children JAX filled with None, e.g. for shardings or
            qa._structure(present)  # layouts: the same structure)
        return qa

    # -- values -----------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """``len(shape)``."""
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored arrays (what a checkpoint of this weight costs)."""
        return int(sum(np.dtype(a.dtype).itemsize * math.prod(np.shape(a)) for a in self._leaves))

    def int_codes(self) -> jax.Array:
        """The codes as an int8 array of ``shape`` (unpacked for 4 bits or fewer)."""
        if self.bits <= 4:
            return unpack_int4(jnp.asarray(self.codes), self.shape)
        return jnp.asarray(self.codes)

    def full(self, v: Any) -> Any:
        """A scale or zero point broadcastable to ``shape`` (groups repeated)."""
        if v is None or self.group_size is None:
            return v
        return jnp.repeat(jnp.asarray(v), self.group_size, axis=self.group_axis)

    def dequantize(self) -> jax.Array:
        """``scale * (codes - zero_point)`` as ``dtype``, with ``simulated_quantize``'s arithmetic
        (float32, then cast). The weight as its layer computes with it: for a layer smoothed by
        SmoothQuant or AWQ that is ``s * W`` (each input channel scaled by its factor, which the
        program divides the activation by), not ``W``."""
        q = self.int_codes().astype(jnp.float32)
        if self.zero_point is not None:
            q = q - self.full(self.zero_point).astype(jnp.float32)
        return (q * self.full(self.scale)).astype(self.dtype)

    def __repr__(self) -> str:
        kind = f"int{self.bits}" + (f" group({self.group_size})" if self.group_size else "")
        zp = "" if self.zero_point is None else " asym"
        stack = f", layers={self.layers}" if self.layers else ""
        return f"QArray({kind}{zp}, shape={self.shape}, dtype={self.dtype.name}{stack})"


def _aux_to_bytes(aux: tuple[Any, ...]) -> bytes:
    shape, dtype, bits, group_axis, group_size, layers, present = aux
    return json.dumps(
        [list(shape), dtype, bits, group_axis, group_size, layers, list(present)]
    ).encode()


def _aux_from_bytes(data: bytes) -> tuple[Any, ...]:
    shape, dtype, bits, group_axis, group_size, layers, present = json.loads(data)
    return (tuple(shape), dtype, bits, group_axis, group_size, layers, tuple(present))


# ``jax.export`` of a function taking QArrays (``jax.jit(qf.apply)``) can be serialized
jax.export.register_pytree_node_serialization(
    QArray,
    serialized_name="jaxq.QArray",
    serialize_auxdata=_aux_to_bytes,
    deserialize_auxdata=_aux_from_bytes,
)


def register_flax_serialization() -> None:
    """Teach ``flax.serialization`` (``to_bytes`` / ``from_bytes`` / ``to_state_dict``) QArrays as
    a dict of their arrays, once flax is imported: jaxq does not import flax itself, and Flax's
    msgpack refuses a type it does not know ("can not serialize 'QArray' object")."""
    global _flax_registered
    serialization = sys.modules.get("flax.serialization")
    if serialization is None or _flax_registered:
        return

    def to_state(q: QArray) -> dict[str, Any]:
        return {k: serialization.to_state_dict(v) for k, v in q._keyed}

    def from_state(target: QArray, state: dict[str, Any]) -> QArray:
        missing = [k for k, _ in target._keyed if k not in state]
        if missing:
            raise ValueError(
                f"the saved state of {target!r} lacks {missing} (it has {sorted(state)}): it was "
                "saved from params quantized with another config; restore into params quantized "
                "like the saved ones"
            )
        leaves = [serialization.from_state_dict(v, state[k], name=k) for k, v in target._keyed]
        return QArray.tree_unflatten(target._aux, leaves)

    serialization.register_serialization_state(QArray, to_state, from_state)
    _flax_registered = True


_flax_registered = False


def is_qarray(x: Any) -> bool:
    return isinstance(x, QArray)
