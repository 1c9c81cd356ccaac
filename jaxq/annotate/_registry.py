"""The list of annotation ops, with their support level, for passes and for documentation."""

import dataclasses
from typing import Literal

from jax.extend.core import Primitive

from ._cast_hint import cast_hint_p
from ._compiler_region import compiler_begin_p, compiler_end_p
from ._on_device import on_device_p
from ._simulated_quantize import simulated_quantize_p
from ._stop_fusion import stop_fusion_p


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnnotationOp:
    """One annotation op: its primitive name, support level and a one-line summary.

    Attributes:
      name: the primitive's name, also the name of its function in ``jaxq.annotate``.
      level: ``"stable"`` (signature and semantics kept) or ``"experimental"`` (may change).
      summary: what it does, in one line.
      primitive: the JAX primitive itself, for passes that match on it.
    """

    name: str
    level: Literal["stable", "experimental"]
    summary: str
    primitive: Primitive


_REGISTRY = (
    AnnotationOp(
        name="on_device",
        level="stable",
        summary="Identity marking the device a value's computation runs on.",
        primitive=on_device_p,
    ),
    AnnotationOp(
        name="simulated_quantize",
        level="stable",
        summary="Fake quantization (quantize then dequantize) with a straight-through gradient.",
        primitive=simulated_quantize_p,
    ),
    AnnotationOp(
        name="compiler_begin",
        level="stable",
        summary="Identity marking an input of a region for an external compiler.",
        primitive=compiler_begin_p,
    ),
    AnnotationOp(
        name="compiler_end",
        level="stable",
        summary="Identity marking an output of a region for an external compiler.",
        primitive=compiler_end_p,
    ),
    AnnotationOp(
        name="stop_fusion",
        level="stable",
        summary="Identity that lowers to an XLA optimization barrier, preventing fusion across it.",
        primitive=stop_fusion_p,
    ),
    AnnotationOp(
        name="cast_hint",
        level="experimental",
        summary="Identity recording the dtype a value is meant to be stored in (e.g. int8).",
        primitive=cast_hint_p,
    ),
)

IDENTITY_ANNOTATIONS: frozenset[Primitive] = frozenset(
    {on_device_p, compiler_begin_p, compiler_end_p, stop_fusion_p, cast_hint_p}
)
"""Annotations that are identities on values, so removing them never changes results.

`stop_fusion` is among them: removing it changes what XLA may fuse, never a value.
"""

_ANNOTATIONS = frozenset(op.primitive for op in _REGISTRY)
_NAMES = frozenset(p.name for p in _ANNOTATIONS)


def registry() -> tuple[AnnotationOp, ...]:
    """Every annotation op, in a fixed order."""
    return _REGISTRY


def is_annotation(primitive: Primitive | str) -> bool:
    """Whether `primitive` (a Primitive or its name) is one of jaxq's annotation primitives."""
    if isinstance(primitive, str):
        return primitive in _NAMES
    return primitive in _ANNOTATIONS
