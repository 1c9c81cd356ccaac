"""``QArray``: a quantized weight as a pytree node, so quantized params are an ordinary pytree.

``jax.tree.map``, ``jax.device_put(qparams, shardings)``, checkpointing and ``jax.jit`` see its
arrays (``codes``, ``scale``, ``zero_point``) as leaves and its layout as static metadata, exactly as
they see the float params it replaces (models: qwix's ``QArray``, AQT's ``QTensor``).
"""

from __future__ import annotations

import math
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
    lo = lax.shift_right_arithmetic(lax.shift_left(packed, jnp.int8(4)), jnp.int8(4))
    hi = lax.shift_right_arithmetic(packed, jnp.int8(4))
    axis = pack_axis(shape)
    if axis is None:
        return jnp.concatenate([lo, hi])[: math.prod(shape)].reshape(shape)
    return jnp.concatenate([lo, hi], axis=axis)


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the int8 bytes holding int4 codes of ``shape``."""
    axis = pack_axis(shape)
    if axis is None:
        return ((math.prod(shape) + 1) // 2,)
    return tuple(n // 2 if d == axis else n for d, n in enumerate(shape))


@jax.tree_util.register_pytree_with_keys_class
class QArray:
    """A quantized array: ``value = scale * (codes - zero_point)`` in the original ``dtype``.

    Attributes:
      codes: int8 codes of ``shape`` (offset into the signed range), or for ``bits <= 4`` two codes
        per byte (see :func:`pack_int4`).
      scale: float32, broadcastable to ``shape``; with ``group_size`` its ``group_axis`` holds one
        entry per group of ``group_size`` consecutive elements.
      zero_point: int32 like ``scale`` (in code units, offset like the codes), or None (symmetric).
      shape, dtype: the float array it stands for. bits: code width.
    """

    def __init__(
        self,
        codes: Any,
        scale: Any,
        zero_point: Any = None,
        *,
        shape: tuple[int, ...],
        dtype: Any,
        bits: int = 8,
        group_axis: int | None = None,
        group_size: int | None = None,
    ) -> None:
        self.codes, self.scale, self.zero_point = codes, scale, zero_point
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.bits = int(bits)
        self.group_axis, self.group_size = group_axis, group_size
        # static metadata, computed once: flattening runs on every call of a jitted function
        self._aux = (
            self.shape,
            self.dtype.name,
            self.bits,
            group_axis,
            group_size,
            zero_point is not None,
        )

    # -- pytree -----------------------------------------------------------------------------------
    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        if self.zero_point is None:
            return (self.codes, self.scale), self._aux
        return (self.codes, self.scale, self.zero_point), self._aux

    def tree_flatten_with_keys(self) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        key = jax.tree_util.GetAttrKey
        children = [(key("codes"), self.codes), (key("scale"), self.scale)]
        if self.zero_point is not None:
            children.append((key("zero_point"), self.zero_point))
        return children, self._aux

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: list[Any]) -> QArray:
        shape, dtype, bits, group_axis, group_size, has_zp = aux
        codes, scale, *rest = children
        zp = rest[0] if has_zp else None
        return cls(
            codes,
            scale,
            zp,
            shape=shape,
            dtype=dtype,
            bits=bits,
            group_axis=group_axis,
            group_size=group_size,
        )

    # -- values -----------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored arrays (what a checkpoint of this weight costs)."""
        arrays = (self.codes, self.scale, self.zero_point)
        return int(
            sum(
                np.dtype(a.dtype).itemsize * math.prod(np.shape(a)) for a in arrays if a is not None
            )
        )

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
        (float32, then cast)."""
        q = self.int_codes().astype(jnp.float32)
        if self.zero_point is not None:
            q = q - self.full(self.zero_point).astype(jnp.float32)
        return (q * self.full(self.scale)).astype(self.dtype)

    def __repr__(self) -> str:
        kind = f"int{self.bits}" + (f" group({self.group_size})" if self.group_size else "")
        zp = "" if self.zero_point is None else " asym"
        return f"QArray({kind}{zp}, shape={self.shape}, dtype={self.dtype.name})"


def is_qarray(x: Any) -> bool:
    return isinstance(x, QArray)
