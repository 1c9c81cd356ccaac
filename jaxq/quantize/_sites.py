"""Sites: which equations are quantized (rules over names), and their geometry (which weight axis
holds the output channels, which axes are contracted, which activation axes are reduced per
token)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxq._walk import Visit
from jaxq.quantize._config import ELEMENTWISE, EMBEDDING, INHERIT, OPT_IN, QConfig, Scheme
from jaxq.quantize._state import (
    QuantizeError,
    Site,
    shaped_aval,
)

# ---- rules: which scheme applies where ------------------------------------------------------------


def resolve(
    config: QConfig, name: str, primitive: str, path: str | None = None
) -> tuple[Scheme | None, Scheme | None, int | None]:
    """``(weights, activations, rule index)`` for an equation whose weight is the param at
    ``path`` (if any); weights None means float."""
    if primitive in OPT_IN:  # opt-in: a rule must name the primitive; weights only
        for i, rule in enumerate(config.rules):
            if (
                rule.primitives
                and primitive in rule.primitives
                and rule.matches(name, primitive, path)
            ):
                w = (
                    None
                    if rule.skip
                    else config.weights
                    if rule.weights is INHERIT
                    else rule.weights
                )
                return w, None, i
        return None, None, None
    for i, rule in enumerate(config.rules):
        if rule.matches(name, primitive, path):
            if rule.skip:
                return None, None, i
            w = config.weights if rule.weights is INHERIT else rule.weights
            a = config.activations if rule.activations is INHERIT else rule.activations
            return w, a, i
    return config.weights, config.activations, None


# ---- geometry -----------------------------------------------------------------------------------


def _dot_geometry(visit: Visit, wi: int) -> tuple[int, tuple[int, ...], tuple[int, ...]] | str:
    (lc, rc), (lb, rb) = visit.params["dimension_numbers"]
    shapes = [shaped_aval(v).shape for v in visit.eqn.invars]
    wc, wb = (lc, rc)[wi], (lb, rb)[wi]
    ac = (lc, rc)[1 - wi]
    free = [d for d in range(len(shapes[wi])) if d not in wc and d not in wb]
    if not free:
        return "the weight has no output-channel axis"
    lay = visit.in_layouts[wi] if visit.in_layouts else None
    letter = "O" if wi == 1 else "N"
    channel = lay.index(letter) if lay and letter in lay else free[0]
    if channel not in free:  # (a weight tied to another layer, read transposed: its layout is
        channel = free[0]  # the other layer's, whose output axis this one contracts)
    return channel, tuple(wc), tuple(ac)


def _conv_geometry(visit: Visit, wi: int) -> tuple[int, tuple[int, ...], tuple[int, ...]] | str:
    if wi != 1:
        return "the convolution's input (not its kernel) is constant"
    p = visit.params
    if p["batch_group_count"] != 1:
        return "batch_group_count > 1"
    dn = p["dimension_numbers"]
    lay = visit.in_layouts[1] if visit.in_layouts else None
    channel = lay.index("O") if lay and "O" in lay else dn.rhs_spec[0]
    nd = len(dn.rhs_spec)
    lhs_nd = len(dn.lhs_spec)
    contract = tuple(d for d in range(nd) if d != channel)
    reduce = tuple(d for d in range(lhs_nd) if d != dn.lhs_spec[0])
    return channel, contract, reduce


def _elementwise_geometry(
    visit: Visit, wi: int, weights: Scheme
) -> tuple[int, tuple[int, ...], tuple[int, ...]] | str:
    shape = shaped_aval(visit.eqn.invars[wi]).shape
    if weights.granularity == "group":
        raise QuantizeError(
            f"quantize: granularity='group' applies to matmul weights; {visit.name!r} is a "
            f"{visit.primitive}. Use 'tensor' or 'channel' in its Rule."
        )
    if not shape and weights.granularity == "channel":
        return "a scalar operand has no channel axis"
    return max(len(shape) - 1, 0), (), ()


def _gather_geometry(
    visit: Visit, wi: int, weights: Scheme
) -> tuple[int, tuple[int, ...], tuple[int, ...]] | str:
    """A gather of whole rows along one table axis (``emb[ids]``, ``jnp.take(emb, ids,
    axis=k)``): that axis holds one scale per row ("channel"), or one for the table ("tensor")."""
    if wi != 0:
        return "the gather's indices are constant, its table is not"
    table = shaped_aval(visit.eqn.invars[0])
    if not jnp.issubdtype(table.dtype, jnp.floating):
        return f"the table is {table.dtype}, not floating point"
    if weights.granularity not in ("tensor", "channel"):
        raise QuantizeError(
            f"quantize: granularity={weights.granularity!r} does not apply to an embedding "
            f"table ({visit.name!r}, a gather); give its Rule weights=Scheme(granularity="
            "'channel') (one scale per row) or 'tensor'"
        )
    dn = visit.params["dimension_numbers"]
    sizes = tuple(visit.params["slice_sizes"])
    # (a start along an axis taken whole is 0, or out of range where the float gather fills
    # too: vmap of a dynamic_slice, an Equinox Embedding's emb[i], indexes every axis)
    partial = [d for d in dn.start_index_map if sizes[d] != table.shape[d]]
    rows = partial or list(dn.start_index_map[:1])
    if len(rows) != 1 or tuple(getattr(dn, "operand_batching_dims", ())):
        return "the gather does not select rows along one table axis"
    (k,) = rows
    if sizes[k] != 1 or any(n != table.shape[d] for d, n in enumerate(sizes) if d != k):
        return "the gather takes partial slices of the table, not whole rows"
    return k, (), ()


def gptq_input_axis(visit: Visit, site: Site) -> int | None:
    """The activation axis whose second moment GPTQ needs, or None where it does not apply
    (convolutions, batched matmuls, several contracted axes)."""
    if site.primitive != "dot_general" or len(site.contract_axes) != 1:
        return None
    (lc, rc), (lb, rb) = visit.params["dimension_numbers"]
    if lb or rb:
        return None
    return (lc, rc)[1 - site.weight_index][0]


def make_site(
    visit: Visit,
    config: QConfig,
    wi: int,
    weights: Scheme,
    acts: Scheme | None,
    rule: int | None,
    in_loop: bool,
    layers: int = 0,
) -> Site | str:
    shapes = [shaped_aval(v).shape for v in (*visit.eqn.invars, *visit.eqn.outvars)]
    if any(isinstance(d, int) and d == 0 for shape in shapes for d in shape):
        return "an empty operand or output (a size-0 axis): nothing to quantize"
    if visit.primitive in ELEMENTWISE:
        geo = _elementwise_geometry(visit, wi, weights)
    elif visit.primitive in EMBEDDING:
        geo = _gather_geometry(visit, wi, weights)
    elif visit.primitive == "dot_general":
        geo = _dot_geometry(visit, wi)
    else:
        geo = _conv_geometry(visit, wi)
    if isinstance(geo, str):
        return geo
    channel, contract, reduce = geo
    w_aval = shaped_aval(visit.eqn.invars[wi])
    if weights.granularity == "group":
        ruled = None if rule is None else config.rules[rule].weights
        by_rule = isinstance(ruled, Scheme) and ruled.granularity == "group"
        k = w_aval.shape[contract[0]] if len(contract) == 1 else 0
        matmul = visit.primitive == "dot_general" and len(w_aval.shape) == 2 and k
        if not matmul or k % (weights.group_size or 1):
            if by_rule:
                raise QuantizeError(
                    f"quantize: granularity='group' needs a 2-D weight with one contracted axis "
                    f"(a matmul) whose size group_size={weights.group_size} divides; "
                    f"{visit.name!r} (rules[{rule}]) is a {visit.primitive} with weight shape "
                    f"{tuple(w_aval.shape)}. Give it 'channel' granularity in that Rule"
                    + ("." if not matmul else f", or a group_size that divides {k}.")
                )
            # (the config's default meets a convolution, an N-D kernel such as a Flax
            # DenseGeneral in attention, or a narrow layer such as Mamba's dt_proj: one scale
            # per channel there; annotate says which)
            weights = dataclasses.replace(weights, granularity="channel", group_size=None)
    if weights.granularity == "group" and config.requantize == "fixed_point":
        raise QuantizeError(
            f"quantize: requantize='fixed_point' cannot combine group-wise weight scales "
            f"({visit.name!r}); use requantize='float' or granularity='channel'"
        )
    extra: tuple[int, ...] = ()  # (a matmul's batch and other output axes: scales of their own)
    if weights.granularity == "channel" and visit.primitive == "dot_general":
        extra = tuple(d for d in range(len(w_aval.shape)) if d != channel and d not in contract)
    return Site(
        name=visit.name,
        primitive=visit.primitive,
        weight_index=wi,
        weights=weights,
        activations=acts,
        rule=rule,
        channel_axis=channel,
        contract_axes=contract,
        reduce_axes=reduce,
        in_loop=in_loop,
        layers=layers,
        extra_scale_axes=extra,
    )


def dot_to_out(v: Any, operand: int, dn: Any, ranks: tuple[int, int]) -> Any:
    """An array over one operand's axes (contracted axes of size 1) -> broadcastable to the
    dot_general output (batch dims in dimension-number order, lhs free, rhs free)."""
    if np.ndim(v) == 0:
        return v
    xp = np if isinstance(v, (np.ndarray, np.generic)) else jnp
    (lc, rc), (lb, rb) = dn
    contract, batch = (lc, rc)[operand], (lb, rb)[operand]
    free = [d for d in range(ranks[operand]) if d not in contract and d not in batch]
    other_free = [
        d
        for d in range(ranks[1 - operand])
        if d not in (lc, rc)[1 - operand] and d not in (lb, rb)[1 - operand]
    ]
    kept = [*batch, *free]
    sizes = tuple(np.shape(v)[d] for d in kept)
    if kept != sorted(kept):  # (the contracted axes have size 1: only the others' order counts)
        v = xp.transpose(v, [*kept, *contract])
    ones = (1,) * len(other_free)
    nb = len(batch)
    shape = sizes[:nb] + (ones + sizes[nb:] if operand == 1 else sizes[nb:] + ones)
    return v if tuple(np.shape(v)) == shape else v.reshape(shape)


def nonfinite_rows(visit: Visit, site: Site, a: Any) -> jax.Array | None:
    """Where the output depends on an activation row holding NaN or Inf: a float array, NaN at
    those rows and 0 elsewhere, that broadcasts against the output (a matmul's rows; a
    convolution's samples), or None for an operand already in int8 with no mask. Quantization
    would turn those values into finite codes, so both modes make those outputs NaN, and no
    other output changes (see :func:`poison_rows`)."""
    if hasattr(a, "bad"):  # int8 codes from a pass-through chain: the mask it carried
        mask = a.bad
        if mask is None:
            return None
        poison = lambda bad: jnp.where(bad, jnp.float32(jnp.nan), jnp.float32(0))
        if np.ndim(mask) == 0:
            return poison(mask)
        reduce = lambda axes, keep: poison(jnp.any(mask, axis=axes, keepdims=keep))
    elif not hasattr(a, "dtype") or not jnp.issubdtype(a.dtype, jnp.floating):
        return None
    else:  # the largest |a| of a row, NaN counted as Inf, is Inf exactly where the row holds
        # NaN or Inf, so times 0 it is NaN there and 0 elsewhere. (NaN is replaced first: XLA:CPU's
        # max of a row about 1000 wide or more drops NaN, on jax 0.10 and 0.12 alike; a sum of
        # a * 0 is exact too, but fuses worse around convolutions: CNN 0.72x -> 0.51x of float.)
        def reduce(axes: tuple[int, ...], keep: bool) -> jax.Array:
            mag = lax.select(jnp.isnan(a), jnp.full_like(a, jnp.inf), lax.abs(a))
            mag = mag.astype(jnp.float32)
            return jnp.max(mag, axis=axes, keepdims=keep) * jnp.float32(0)

    if site.primitive == "dot_general":
        dn = visit.params["dimension_numbers"]
        ai = 1 - site.weight_index
        ranks = (
            len(shaped_aval(visit.eqn.invars[0]).shape),
            len(shaped_aval(visit.eqn.invars[1]).shape),
        )
        return dot_to_out(reduce(tuple(dn[0][ai]), True), ai, dn, ranks)
    if site.primitive == "conv_general_dilated":
        dn = visit.params["dimension_numbers"]
        n = dn.lhs_spec[0]
        rank = len(dn.lhs_spec)
        per_sample = reduce(tuple(d for d in range(rank) if d != n), False)
        shape = [1] * len(dn.out_spec)
        shape[dn.out_spec[0]] = -1
        return per_sample.reshape(shape)
    return None  # (elementwise sites: NaN and Inf pass through as they are)


def poison_rows(y: jax.Array, bad: Any) -> jax.Array:
    """``y`` with NaN in the rows ``bad`` marks (see :func:`nonfinite_rows`), others unchanged:
    an add of a row vector of 0 / NaN, which broadcasts in every runtime and costs no select."""
    if bad is None:
        return y
    return y + bad.astype(y.dtype)
