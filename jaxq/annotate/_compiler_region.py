"""`compiler_begin` / `compiler_end`: the boundaries of a region meant for an external compiler."""

import jax.numpy as jnp
from jax.typing import ArrayLike

from ._identity import annotate_tangents, as_array, identity_annotation

compiler_begin_p = identity_annotation("compiler_begin")
compiler_end_p = identity_annotation("compiler_end")
# Tangents flow forwards, so they keep the boundary they cross; cotangents flow backwards, so a
# value entering a region leaves the transposed region there, and the boundaries swap.
annotate_tangents(compiler_begin_p, compiler_end_p)
annotate_tangents(compiler_end_p, compiler_begin_p)


def _check_compiler(op: str, compiler: object) -> str:
    if not isinstance(compiler, str):
        raise TypeError(f"{op}: compiler must be a non-empty string; got {compiler!r}")
    if not compiler:
        raise ValueError(f"{op}: compiler must be a non-empty string; got {compiler!r}")
    if "." in compiler:  # (as register_op_support: '.' separates a composite's compiler)
        raise ValueError(f"{op}: compiler must not contain '.'; got {compiler!r}")
    return compiler


def compiler_begin(x: ArrayLike, compiler: str) -> jnp.ndarray:
    """Return `x`, marking it as an input of a region that `compiler` will compile."""
    return compiler_begin_p.bind(
        as_array(x, "compiler_begin"), compiler=_check_compiler("compiler_begin", compiler)
    )


def compiler_end(x: ArrayLike, compiler: str) -> jnp.ndarray:
    """Return `x`, marking it as an output of a region that `compiler` will compile."""
    return compiler_end_p.bind(
        as_array(x, "compiler_end"), compiler=_check_compiler("compiler_end", compiler)
    )
