"""What the quantization passes share: sites, quantized weights, calibrated scales and the
plan for each param leaf, kept in ``program.meta["quantize"]`` and keyed by stable names, so a
phase (or a re-trace at new shapes) finds them again."""

from __future__ import annotations

import dataclasses
import hashlib
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import jax
import numpy as np

from jaxq import _compat as C
from jaxq._program import Program
from jaxq.quantize._config import QConfig, Scheme
from jaxq.quantize._params import (
    CHAIN,
    LeafPlan,
)

if TYPE_CHECKING:
    from jax.core import ShapedArray

FOLDABLE = (
    *CHAIN,
    "reshape",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "slice",
    "split",
    "concatenate",
    "reduce_precision",
)
"""Equations the phases follow a weight through (the chain) or note a param's value after."""
REMATS = ("checkpoint", "remat2")
INLINE = ("jit", "pjit", "closed_call", "core_call", *REMATS)
"""Calls the quantization phases evaluate in place, so the layers inside are found and quantized
like any other. Remat (``jax.checkpoint``, Flax ``nn.remat``) too, its body then wrapped in a
remat with the same policy again (simulate and realize), so a QAT gradient saves what it saved."""
META_KEY = "quantize"


QParam: TypeAlias = "jax.Array | np.float32"
"""A scale or zero point: traced (dynamic) or a host float32 scalar (calibrated, folded in numpy)."""


def shaped_aval(atom: Any) -> ShapedArray:
    """``atom.aval`` as a ShapedArray: quantized operands are arrays, but JAX types ``Var.aval`` as
    the base ``AbstractValue``, which has no shape or dtype."""
    return cast("ShapedArray", atom.aval)


class QuantizeError(ValueError):
    """A quantization phase cannot proceed; the message names the layer."""


# ---- data kept in Program.meta -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Site:
    """One quantized equation."""

    name: str
    primitive: str
    weight_index: int
    weights: Scheme
    activations: Scheme | None
    rule: int | None
    channel_axis: int  # weight axis with one scale per channel
    contract_axes: tuple[int, ...]  # weight axes contracted away
    reduce_axes: tuple[int, ...]  # activation axes reduced per token
    in_loop: bool = False  # inside scan / while / cond: not reachable by calibration
    # > 0: a layer of a stack run by ``lax.scan`` (its weight a slice of a stacked param), with
    # that many iterations, each calibrated with scales of its own (keys ``name@i``)
    layers: int = 0
    # weight axes besides the channel axis that per-channel scales run along: a dot's batch
    # axes (MoE experts, a vmapped ensemble: separate matrices) and its other output axes (a
    # DenseGeneral's heads, the members of an ensemble that share one input)
    extra_scale_axes: tuple[int, ...] = ()

    @property
    def scale_axes(self) -> tuple[int, ...]:
        """The weight axes a per-channel scale runs along (the others have size 1): every axis
        but the contracted ones."""
        return tuple(sorted((*self.extra_scale_axes, self.channel_axis)))

    def static_act(self, dynamic: bool) -> bool:
        """Whether this layer's activations get calibrated scales (and zero points)."""
        a = self.activations
        return a is not None and a.granularity == "tensor" and not dynamic and not self.in_loop

    def act_keys(self) -> list[str]:
        """The keys of this layer's calibrated activation parameters (``QState.act``): its name,
        or one per iteration of a layer stack."""
        return [f"{self.name}@{i}" for i in range(self.layers)] if self.layers else [self.name]


@dataclasses.dataclass(frozen=True, eq=False)
class QWeight:
    """A weight quantized once: signed codes (offset into the signed range of ``bits``) and the
    scale / zero point broadcastable against the weight (zero point in code units, offset too).
    Host numpy arrays for a constant weight; traced arrays for a param (``view_qweight``)."""

    codes: Any  # int8, the weight's shape
    scale: Any  # float32, broadcastable to the weight (full size for groups)
    zero_point: Any  # int32, broadcastable like scale
    offset: int  # codes = unsigned codes + offset (0 for signed schemes)
    bits: int
    group_scale: Any = None  # [channels, groups] for granularity="group"
    group_zero_point: Any = None
    method: str = "minmax"  # how the codes were chosen: "minmax", "mse" or "gptq"
    sums: Any = None  # a param's stored code sums over the contracted axes (kept), or None
    packed: Any = None  # a param's stored int4 bytes (``pack_int4`` of ``codes``), or None
    digest: bytes | None = None  # a constant weight's content hash (see ``weight_digest``)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape


def weight_digest(w: Any) -> bytes:
    """A constant weight's content hash: which weight a layer's codes were made from."""
    a = np.ascontiguousarray(np.asarray(w))
    h = hashlib.blake2b(a.view(np.uint8).reshape(-1).data, digest_size=16)
    h.update(repr((a.shape, a.dtype.str)).encode())
    return h.digest()


@dataclasses.dataclass(frozen=True)
class ActParams:
    scale: float
    zero_point: int  # in the scheme's own code range (not offset)


@dataclasses.dataclass(frozen=True, eq=False)
class QState:
    """Everything the quantization passes share, stored as ``program.meta["quantize"]``."""

    config: QConfig
    source: Program  # the float program (named, with layouts)
    sites: Mapping[str, Site]
    skipped: Mapping[str, str]  # equation name -> why it stays float
    weights: Mapping[str, QWeight]
    act: Mapping[str, ActParams] = dataclasses.field(default_factory=dict)
    matched_rules: frozenset[int] = frozenset()
    calibration: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mode: str = "simulate"
    act_absmax: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """Per-input-channel ``max |X|`` of smoothed layers (``QConfig.smoothing``)."""
    smooth: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """SmoothQuant factors ``s`` per layer (the activation is divided by them, the weight times)."""
    params: ParamSpec | None = None
    """Which program inputs are the params (``jaxq.quantize(f, params)``), else None."""
    leaves: Mapping[int, LeafPlan] = dataclasses.field(default_factory=dict)
    """Quantized param leaves by flat index: the layer each feeds, and how."""
    site_leaves: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """The param leaf of every site whose weight is one (several sites may share a leaf: a
    tied embedding table and output projection)."""
    float_reads: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """The param leaves each layer left float reads (by flat index)."""
    act_act: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Matmuls of two activations run in int8 (``QConfig.attention``): name -> scheme."""
    float_leaves: frozenset[int] = frozenset()
    """Param leaves that some equation reads as floats besides their layers (an embedding
    lookup left in float): their codes must hold the weight itself, never ``s W``."""
    grams: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """GPTQ's ``X^T X`` per layer (params style: the codes are chosen by ``quantize_params``)."""
    output: Any = None
    """The jaxpr the last phase produced: a later phase given another program re-reads it."""
    kv_caches: tuple[str, ...] = ()
    """The loops whose float KV cache carries became int8 codes (``QConfig.kv_cache``)."""

    def replace(self, **changes: Any) -> QState:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """The params argument of the traced function: ``args[argnum]``, flat inputs
    ``[start, start + len(paths))`` of the program."""

    argnum: int
    start: int
    paths: tuple[str, ...]
    avals: tuple[Any, ...]
    tree: Any

    @property
    def count(self) -> int:
        return len(self.paths)


def param_spec(program: Program, argnum: int) -> ParamSpec:
    """Locate ``args[argnum]`` among the program's flat inputs."""
    n = len(program.jaxpr.in_avals)
    args, _ = jax.tree.unflatten(program.in_tree, list(range(n)))
    if not 0 <= argnum < len(args):
        raise QuantizeError(
            f"quantize: params are argument {argnum}, but the function takes {len(args)} "
            "positional arguments"
        )
    idx, tree = jax.tree.flatten(args[argnum])
    start = idx[0] if idx else 0
    paths = tuple(
        program.in_paths[i].removeprefix(f"args[{argnum}]") or f"args[{argnum}]" for i in idx
    )
    avals = tuple(program.jaxpr.in_avals[i] for i in idx)
    return ParamSpec(argnum, start, paths, avals, tree)


def is_concrete(v: Any) -> bool:
    return not C.is_tracer(v)


def get_state(program: Program, who: str) -> QState:
    state = program.meta.get(META_KEY) if program.meta else None
    if not isinstance(state, QState):
        raise QuantizeError(
            f"{who}: the program carries no quantization state.\n"
            "Run jaxq.quantize.annotate(config) on it first, e.g.\n"
            "  program = jaxq.quantize.annotate(QConfig())(jaxq.trace(f, x))"
        )
    return state


def with_state(program: Program, state: QState) -> Program:
    meta = dict(program.meta or {})
    meta[META_KEY] = state
    return program.replace(meta=types.MappingProxyType(meta))
