"""Constants as arguments, so weights can be placed and sharded like any other array.

A traced program closes over its weights (they are the jaxpr's constants). To shard weights across
a device mesh they must be arguments of the jitted function: :func:`split_constants` gives
``fun(consts, *args)`` and the constants, and :func:`constant_shardings` picks a ``NamedSharding``
for each constant from its inferred layout: output channels (``O`` of ``IO`` / ``HWIO`` weights,
and every per-channel vector that lines up with them, such as scales and biases) split over one
mesh axis, everything else replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxq import _compat as C
from jaxq._layouts import layout_map
from jaxq._program import Program

_CHANNEL_LETTERS = ("O",)  # output channels of dot_general and conv weights
_VECTOR_LETTERS = ("O", "C")  # per-channel vectors (scales, biases) of dot and conv outputs


def split_constants(program: Program) -> tuple[Callable[..., Any], list[Any]]:
    """``(fun, consts)`` with ``fun(consts, *args, **kwargs) == program(*args, **kwargs)``."""
    closed = program.jaxpr

    def fun(consts: list[Any], *args: Any, **kwargs: Any) -> Any:
        flat = program.flatten_args(args, kwargs)
        run = C.jaxpr_as_fun(C.ClosedJaxpr(closed.jaxpr, list(consts)))
        return jax.tree.unflatten(program.out_tree, run(*flat))

    return fun, list(closed.consts)


def constant_shardings(program: Program, mesh: Mesh, axis: str) -> list[NamedSharding]:
    """A sharding per constant: split along its output-channel axis over mesh axis ``axis`` when the
    layout is known and the size divides evenly, otherwise replicated."""
    if axis not in mesh.axis_names:
        raise ValueError(f"constant_shardings: mesh has no axis {axis!r}; axes: {mesh.axis_names}")
    lay = program.layouts if program.layouts is not None else layout_map(program.jaxpr)
    n = mesh.shape[axis]
    out = []
    for var, const in zip(program.jaxpr.jaxpr.constvars, program.jaxpr.consts, strict=True):
        layout, shape = lay.get(var), np.shape(const)
        spec: list[str | None] = [None] * len(shape)
        letters = _VECTOR_LETTERS if len(shape) == 1 else _CHANNEL_LETTERS
        if layout:
            for d, letter in enumerate(layout):
                if letter in letters and shape[d] % n == 0:
                    spec[d] = axis
                    break
        out.append(NamedSharding(mesh, PartitionSpec(*spec)))
    return out
