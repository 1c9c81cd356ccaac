"""Shardings for quantized params: each QArray split along its output channels over a mesh axis.

A per-channel QArray says which axes hold its channels: those its scale runs along (a batched
weight's experts first, then its output channels). Codes, scale and zero point are split along
one of them together, so every device holds the codes and scales of its own channels (or
experts) and the integer matmul needs no gather. Everything else (per-tensor QArrays, biases,
norms, int4 codes packed along their only such axis) is replicated: those leaves are small.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxq.quantize._qarray import QArray, is_qarray, pack_axis


def scale_axes(qa: QArray) -> list[int]:
    """The axes of ``qa`` with one scale per index (none for a per-tensor scale): its output
    channels, and a batched weight's matrices (MoE experts); not the leading axis of a layer
    stack (each layer's own channels are split) nor a group axis."""
    sshape = np.shape(qa.scale)
    return [
        d
        for d, n in enumerate(sshape)
        if n > 1 and n == qa.shape[d] and d != qa.group_axis and not (qa.layers and d == 0)
    ]


def param_shardings(params: Any, mesh: Mesh, axis: str) -> Any:
    """A pytree of ``NamedSharding`` matching ``params`` (QArrays expanded to their arrays), for
    ``jax.device_put(params, param_shardings(params, mesh, axis))``: every per-channel QArray
    split over mesh axis ``axis`` along the first of its scale axes (the experts of an MoE
    weight, else the output channels) that divides evenly and does not hold packed int4
    codes, everything else replicated.

    ``jax.jit`` of ``qf.apply`` on params placed so needs no ``shard_map``. Inside one (data
    parallel: the params replicated, ``in_specs`` ``PartitionSpec()``; a layer is planned for its
    whole weight, not a shard's slice), pass ``check_vma=False``: ``qf.apply`` re-binds a traced
    program, whose equations do not mark replicated values as varying the way ``jax.numpy`` does
    when a function is traced there.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"param_shardings: mesh has no axis {axis!r}; axes: {mesh.axis_names}")
    n = mesh.shape[axis]
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x: Any) -> Any:
        if not isinstance(x, QArray):
            return replicated
        # (not an int4 packing axis: a byte holds indices j and j + C/2 there, so a split of
        # the bytes would not match the scales' split)
        packed = x.bits <= 4 and np.shape(x.codes) != x.shape
        axes = [
            d
            for d in scale_axes(x)
            if not x.shape[d] % n and not (packed and pack_axis(x.shape) in (d, None))
        ]
        if not axes:
            return jax.tree.map(lambda _: replicated, x)
        d = axes[0]
        split = lambda v: NamedSharding(
            mesh, PartitionSpec(*[axis if i == d else None for i in range(np.ndim(v))])
        )
        return jax.tree.map(split, x)

    return jax.tree.map(one, params, is_leaf=is_qarray)
