"""The machinery shared by annotations that are identities on values.

`on_device`, `compiler_begin`, `compiler_end`, `stop_fusion` and `cast_hint` differ only in their
params, their lowering and how they treat tangents, so the rules are written once here.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

Lowering = Callable[..., Any]


def as_array(x: Any, who: str) -> jax.Array:
    """``x`` as an array; a container (tuple, list, dict) is an error, not an array stacked from
    its leaves (what ``jnp.asarray`` would make of a tuple of arrays)."""
    if isinstance(x, (tuple, list, dict)):
        raise TypeError(
            f"{who}: expected one array, got a {type(x).__name__}; annotate each array of a "
            f"pytree: jax.tree.map(lambda a: jaxq.annotate.{who}(a{'' if who == 'stop_fusion' else ', ...'}), tree)"
        )
    return jnp.asarray(x)


def _pass_through(ctx: Any, x: Any, **params: Any) -> list[Any]:
    del ctx, params
    return [x]


def identity_annotation(name: str, *, lowering: Lowering | None = None) -> Primitive:
    """A primitive that returns its single operand, carrying its params as metadata.

    Registers impl, abstract eval, lowering (a pass-through unless `lowering` is given; no platform
    argument, so it applies to CPU and GPU alike) and batching. Differentiation is registered by the
    caller with `annotate_tangents` or `plain_tangents`, because that choice is per annotation.
    """
    p = Primitive(name)
    p.def_impl(lambda x, **params: x)
    p.def_abstract_eval(lambda x, **params: x)
    mlir.register_lowering(p, lowering if lowering is not None else _pass_through)

    def batch(args: Any, dims: Any, **params: Any) -> tuple[Any, Any]:
        (x,), (d,) = args, dims
        return p.bind(x, **params), d

    batching.primitive_batchers[p] = batch
    return p


def annotate_tangents(p: Primitive, cotangent_p: Primitive | None = None) -> None:
    """Make `p` linear: tangents go through `p` and cotangents through `cotangent_p` (default `p`).

    Used where the annotation should hold for the derivative computation too: work placed on a
    device has its derivative placed there, and a fusion barrier stays a barrier going backwards.
    """
    ct_p = p if cotangent_p is None else cotangent_p
    ad.deflinear2(p, lambda ct, x, **params: [ct_p.bind(ct, **params)])


def plain_tangents(p: Primitive) -> None:
    """Annotate only the primal; the tangent passes through unchanged, as in `checkpoint_name`."""

    def jvp(primals: Any, tangents: Any, **params: Any) -> tuple[Any, Any]:
        (x,), (t,) = primals, tangents
        return p.bind(x, **params), t

    ad.primitive_jvps[p] = jvp
    # as a linear map (jax.linear_transpose of a function that annotates its linear input) it is
    # the identity too, and so is its transpose
    ad.primitive_transposes[p] = lambda ct, x, **params: [ct]
