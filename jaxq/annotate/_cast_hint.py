"""`cast_hint`: record the dtype a value is meant to be stored in (e.g. int8 when quantized)."""

import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from ._identity import as_array, identity_annotation, plain_tangents

cast_hint_p = identity_annotation("cast_hint")
# The hint describes how the primal is stored; a tangent of a quantized value is not stored as int8.
plain_tangents(cast_hint_p)


def cast_hint(x: ArrayLike, dtype: DTypeLike) -> jnp.ndarray:
    """Return `x` unchanged, recording that it is meant to be stored as `dtype`.

    `dtype` is kept as its numpy name (`"int8"`, `"bfloat16"`) so the param is hashable and prints
    in jaxprs; a later pass decides whether to honour it.
    """
    try:
        if dtype is None:  # (jnp.dtype(None) is float64)
            raise TypeError
        name = jnp.dtype(dtype).name
    except TypeError as e:
        raise TypeError(f"cast_hint: dtype must be a numpy dtype; got {dtype!r}") from e
    return cast_hint_p.bind(as_array(x, "cast_hint"), dtype=name)
