"""Shardings for quantized params: each QArray split along its output channels over a mesh axis.

A per-channel QArray says which axis holds its channels: the one its scale runs along. Codes,
scale and zero point are split there together, so every device holds the codes and scales of its
own channels and the integer matmul needs no gather. Everything else (per-tensor QArrays, biases,
norms, int4 codes packed along their channel axis) is replicated: those leaves are small.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxq.quantize._qarray import QArray, is_qarray, pack_axis


def channel_axis(qa: QArray) -> int | None:
    """The first axis of ``qa`` with one scale per index (None for a per-tensor scale): the
    output channels, or the matrices of a batched weight (MoE experts: expert parallelism); not
    the leading axis of a layer stack (each layer's own channels are split)."""
    sshape = np.shape(qa.scale)
    for d, n in enumerate(sshape):
        if n > 1 and n == qa.shape[d] and d != qa.group_axis and not (qa.layers and d == 0):
            return d
    return None


def param_shardings(params: Any, mesh: Mesh, axis: str) -> Any:
    """A pytree of ``NamedSharding`` matching ``params`` (QArrays expanded to their arrays), for
    ``jax.device_put(params, param_shardings(params, mesh, axis))``: every per-channel QArray
    split along its channel axis over mesh axis ``axis`` where the channels divide evenly,
    everything else replicated.

    ``jax.jit`` of ``qf.apply`` on params placed so needs no ``shard_map``. Inside one, pass
    ``check_vma=False``: ``qf.apply`` re-binds a traced program, whose equations do not mark
    replicated values as varying the way ``jax.numpy`` does when a function is traced there.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"param_shardings: mesh has no axis {axis!r}; axes: {mesh.axis_names}")
    n = mesh.shape[axis]
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x: Any) -> Any:
        if not isinstance(x, QArray):
            return replicated
        d = channel_axis(x)
        # (int4 packed along the channel axis: a byte holds channels j and j + C/2, so a split
        # of the bytes would not match the scales' split)
        packed = x.bits <= 4 and np.shape(x.codes) != x.shape
        if d is None or x.shape[d] % n or (packed and pack_axis(x.shape) in (d, None)):
            return jax.tree.map(lambda _: replicated, x)
        split = lambda v: NamedSharding(
            mesh, PartitionSpec(*[axis if i == d else None for i in range(np.ndim(v))])
        )
        return jax.tree.map(split, x)

    return jax.tree.map(one, params, is_leaf=is_qarray)
