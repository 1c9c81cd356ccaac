"""Integer pass-through chains (realize): shape ops, ReLU and (where the tuning says so) max
pooling that run on int8 codes between two quantized layers instead of dequantizing and quantizing
again."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxq import _compat as C
from jaxq._program import Program
from jaxq.quantize._state import (
    INLINE,
    QState,
    shaped_aval,
)
from jaxq.quantize._tuning import current_tuning

# ---- integer pass-through ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class QTensor:
    """An activation already in the integer domain (realize only): int8 codes whose real value is
    ``scale * (codes - zero_point)``. It only flows from a chain of pass-through equations into the
    quantized equation that planned the chain (see :func:`plan_chains`)."""

    codes: jax.Array
    scale: Any
    zero_point: Any  # int32, offset into the signed range
    bad: Any = None
    """Which samples (leading axis) held NaN or Inf before quantizing: bool, shaped
    ``[N, 1, ...]`` like the codes' rank (or a scalar where a shape op moved the leading axis)."""

    def dequantize(self) -> jax.Array:
        return (self.codes.astype(jnp.int32) - self.zero_point).astype(jnp.float32) * self.scale


_SHAPE_PASS = (
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "slice",
    "rev",
    "copy",
    "copy_p",
    "reduce_window_max",
)
PASS_THROUGH = (*_SHAPE_PASS, "max", "custom_jvp_call")
_POOLS = ("reduce_window_max",)
"""Pass-through equations a chain takes only where the tuning says so (``Tuning.pool_codes``)."""


def _is_zero(atom: Any) -> bool:
    return C.is_literal(atom) and np.ndim(atom.val) == 0 and float(atom.val) == 0.0


def _relu_body(jaxpr: C.Jaxpr) -> bool:
    """``max(x, 0)``, possibly wrapped in single-equation jit calls (``jax.nn.relu``)."""
    while len(jaxpr.eqns) == 1 and jaxpr.eqns[0].primitive.name in INLINE:
        (_, _, sub), *_ = C.subjaxpr_params(jaxpr.eqns[0].params)
        jaxpr = sub.jaxpr if isinstance(sub, C.ClosedJaxpr) else sub
    if len(jaxpr.eqns) != 1 or len(jaxpr.invars) != 1:
        return False
    e = jaxpr.eqns[0]
    return (
        e.primitive.name == "max"
        and jaxpr.invars[0] in e.invars
        and any(_is_zero(a) for a in e.invars)
    )


def passthrough_input(eqn: C.JaxprEqn) -> int | None:
    """Index of the data operand of an equation that commutes exactly with per-tensor quantization
    (shape ops, max pooling, ReLU), else None."""
    prim = eqn.primitive.name
    data = [i for i, v in enumerate(eqn.invars) if not C.is_literal(v)]
    if len(data) != 1 or len(eqn.outvars) != 1:
        return None
    if prim in _SHAPE_PASS:
        return data[0]
    if prim == "max" and any(_is_zero(v) for v in eqn.invars):
        return data[0]
    if prim == "custom_jvp_call":
        body = C.inline_body(eqn)
        return data[0] if body is not None and _relu_body(body.jaxpr) else None
    return None


def plan_chains(source: Program, state: QState) -> dict[str, str]:
    """Equations (by name) whose single-use outputs only feed, through pass-through equations, the
    activation operand of a statically quantized equation: they run on int8 codes in realize.
    Max pooling runs on codes only where the tuning in force says so (``Tuning.pool_codes``)."""
    jaxpr = source.jaxpr.jaxpr
    names = source.names
    tune = current_tuning()
    pool_codes = tune.pool_codes
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    uses = C.use_counts(jaxpr.eqns, jaxpr.outvars)
    chains: dict[str, str] = {}
    for i, e in enumerate(jaxpr.eqns):
        name = names[(i,)]
        site = state.sites.get(name)
        if (
            site is None
            or site.activations is None
            or site.activations.granularity != "tensor"
            or name not in state.act
            or name in state.smooth  # smoothed: divided per channel before quantizing
            or not jnp.issubdtype(shaped_aval(e.invars[1 - site.weight_index]).dtype, jnp.floating)
            or (
                state.config.requantize == "float"  # (fixed point: integer from layer to layer)
                and _few_rows(e, site.weight_index, tune.float_carry_max_rows)
            )
        ):
            continue
        v = e.invars[1 - site.weight_index]
        while not C.is_literal(v) and v in producer and uses.get(v) == 1:
            j = producer[v]
            k = passthrough_input(jaxpr.eqns[j])
            if k is None or (jaxpr.eqns[j].primitive.name in _POOLS and not pool_codes):
                break
            chains[names[(j,)]] = name
            v = jaxpr.eqns[j].invars[k]
    return chains


def few_rows(shape: tuple[Any, ...], contract: Any, most: int) -> bool:
    """Whether a matmul's activation operand of ``shape`` has at most ``most`` rows (its
    elements per contracted vector: every axis but the ``contract`` ones, batch axes included).
    Never where the count is symbolic (a shape-polymorphic batch for ``jax.export``: any size)."""
    rows = math.prod(n for d, n in enumerate(shape) if d not in contract)
    return isinstance(rows, int) and rows <= most


def _few_rows(eqn: C.JaxprEqn, wi: int, most: int) -> bool:
    """Whether a matmul has so few activation rows that realize may carry its sums in f32
    (where they stay exact): it then quantizes a float input itself, NaN carried through its
    f32 codes, where codes from a chain would need a NaN mask (a reduction per layer: 3 of the
    21 kernels of a small CNN at batch 1, per chained layer)."""
    if eqn.primitive.name != "dot_general":
        return False
    (lc, rc), _ = eqn.params["dimension_numbers"]
    return few_rows(shaped_aval(eqn.invars[1 - wi]).shape, (lc, rc)[1 - wi], most)


def sample_chains(source: Program, state: QState, chains: Mapping[str, str]) -> frozenset[str]:
    """The layers whose chains may carry one NaN flag per sample (``[N, 1, ...]``, what an ONNX
    export folds into one reduction): every equation of the chain keeps the leading axis, and
    the layer's rows are the samples (a convolution's batch axis first, or a matmul whose only
    free axis is the first). Other chains carry a flag per value (see :func:`follow_mask`)."""
    eqns = {source.names[(i,)]: e for i, e in enumerate(source.jaxpr.jaxpr.eqns)}
    out = set()
    for name in set(chains.values()):
        e, site = eqns[name], state.sites[name]
        ai = 1 - site.weight_index
        if e.primitive.name == "conv_general_dilated":
            rows_are_samples = e.params["dimension_numbers"].lhs_spec[0] == 0 and ai == 0
        else:
            (lc, rc), (lb, rb) = e.params["dimension_numbers"]
            rank = len(shaped_aval(e.invars[ai]).shape)
            kept = [d for d in range(rank) if d not in (lc, rc)[ai] and d not in (lb, rb)[ai]]
            rows_are_samples = kept == [0] and not (lb, rb)[ai]
        links = [eqns[n] for n, site_name in chains.items() if site_name == name]
        if rows_are_samples and all(_keeps_lead(link) for link in links):
            out.add(name)
    return frozenset(out)


def _keeps_lead(eqn: C.JaxprEqn) -> bool:
    """Whether a pass-through equation leaves its input's leading axis first, whole."""
    prim, p = eqn.primitive.name, eqn.params
    in_shape = shaped_aval(eqn.invars[passthrough_input(eqn) or 0]).shape
    out_shape = shaped_aval(eqn.outvars[0]).shape
    if not in_shape or not out_shape or in_shape[0] != out_shape[0]:
        return False
    if prim == "transpose":
        return p["permutation"][0] == 0
    if prim == "broadcast_in_dim":
        return tuple(p["broadcast_dimensions"])[:1] == (0,)
    if prim == "reduce_window_max":
        return p["window_dimensions"][0] == 1
    if prim == "rev":
        return 0 not in p["dimensions"]
    return True  # (a slice or reshape that keeps the axis's size keeps it whole)


def follow_mask(bad: Any, eqn: C.JaxprEqn) -> Any:
    """Where the values after a pass-through equation were NaN or Inf (the codes cannot say):
    a per-sample mask kept as it is (``sample_chains``), else the equation itself applied to
    the mask, so a reshape or transpose that moves the rows moves their flags with them (a NaN
    row spoils no other)."""
    if bad is None or np.ndim(bad) == 0:
        return bad
    prim, p = eqn.primitive.name, eqn.params
    if prim in ("max", "custom_jvp_call", "copy", "copy_p"):  # (elementwise: the same places)
        return bad
    out_shape = shaped_aval(eqn.outvars[0]).shape
    if all(d == 1 for d in bad.shape[1:]) and _keeps_lead(eqn):
        return bad.reshape((bad.shape[0],) + (1,) * (len(out_shape) - 1))
    spread = jnp.broadcast_to(bad, shaped_aval(eqn.invars[passthrough_input(eqn) or 0]).shape)
    if prim in _POOLS:  # (a max pooling of flags: as int8, whose pooling runs as the codes')
        return eqn.primitive.bind(spread.astype(jnp.int8), **p) > 0
    return eqn.primitive.bind(spread, **p)
