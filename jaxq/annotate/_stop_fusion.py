"""`stop_fusion`: a fusion barrier that survives to XLA as `stablehlo.optimization_barrier`."""

import jax.numpy as jnp
from jax import lax
from jax.interpreters import mlir
from jax.typing import ArrayLike

from ._identity import annotate_tangents, as_array, identity_annotation

stop_fusion_p = identity_annotation(
    "stop_fusion",
    lowering=mlir.lower_fun(lax.optimization_barrier, multiple_results=False),
)
annotate_tangents(stop_fusion_p)


def stop_fusion(x: ArrayLike) -> jnp.ndarray:
    """Return `x`, forbidding XLA to fuse the computation of `x` with its uses.

    Eagerly this is a plain identity (nothing fuses op by op); under `jit` it lowers to an
    optimization barrier. The tangent and cotangent get a barrier too, so the backward pass keeps
    the same fusion boundary. (XLA:CPU in jax 0.10.2 fuses across the barrier all the same;
    0.12 keeps it.)
    """
    return stop_fusion_p.bind(as_array(x, "stop_fusion"))
