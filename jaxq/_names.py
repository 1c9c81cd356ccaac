"""Stable equation names, derived from the tracing name stack.

A name is ``<name stack>/<primitive>`` (Flax linen module paths fill the name stack, so a Dense layer's
matmul is ``CNN/Dense_0/dot_general``), prefixed by the name of the enclosing equation for nested
jaxprs, and made unique program-wide by a numeric suffix (``.../add_1``) in program order. The walk is
pre-order, so the same jaxpr always gives the same names.

``name_expressions()`` bakes each unique name into the equation's name stack. A baked name stack ends
in a scope that *is* the equation's own label (``add_1`` for an ``add``), which this module recognises,
so baked names survive later rewrites unchanged and reach XLA's op metadata.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from typing import Any

from jaxq import _compat as C

Path = tuple[Any, ...]

GROUPS = "names.groups"
"""``program.meta[GROUPS]``: the function names of calls that only group equations (the regions of
``partition_graph``, the segments of ``plan_devices``). Such a call is named by its function name,
and the equations inside keep their own names (``Dense_0/add``, not ``.../jit/Dense_0/add``)."""


def is_baked(scope: str, primitive: str) -> bool:
    return scope == primitive or re.fullmatch(re.escape(primitive) + r"_\d+", scope) is not None


def local_base(eqn: C.JaxprEqn) -> str:
    """The equation's name before the parent prefix and before uniquing."""
    scopes = C.name_stack_scopes(eqn)
    prim = eqn.primitive.name
    if scopes and is_baked(scopes[-1], prim):
        return "/".join(scopes)
    return "/".join((*scopes, prim))


def sub_label(key: str, index: int | None) -> str:
    label = C.sub_label(key)
    return label if index is None else f"{label}{index}"


def sub_jaxprs(eqn: C.JaxprEqn) -> list[tuple[str, C.Jaxpr | C.ClosedJaxpr]]:
    """``(path label, jaxpr)`` for each nested jaxpr of ``eqn``, e.g. ``("branches[1]", ...)``."""
    return [
        (key if idx is None else f"{key}[{idx}]", sub)
        for key, idx, sub in C.subjaxpr_params(eqn.params)
    ]


def child_prefix(eqn: C.JaxprEqn, name: str, label: str) -> str:
    """Prefix for names inside one nested jaxpr of ``eqn``: the parent's name, plus the sub-jaxpr's
    label when the parent has several (``cond/branch1``, ``while/body``)."""
    subs = C.subjaxpr_params(eqn.params)
    if len(subs) == 1:
        return name
    key, _, idx = label.partition("[")
    return f"{name}/{sub_label(key, int(idx[:-1]) if idx else None)}"


class Namer:
    """Hands out program-wide unique names in visiting order."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def unique(self, base: str) -> str:
        if base not in self._seen:
            self._seen[base] = 0
            return base
        k = self._seen[base]
        while True:
            k += 1
            candidate = f"{base}_{k}"
            if candidate not in self._seen:
                self._seen[base] = k
                self._seen[candidate] = 0
                return candidate


def walk_names(
    jaxpr: C.Jaxpr,
    prefix: str = "",
    path: Path = (),
    namer: Namer | None = None,
    groups: Collection[str] = (),
) -> Iterator[tuple[Path, str, str, C.JaxprEqn]]:
    """Pre-order ``(path, full name, local name, eqn)`` over ``jaxpr`` and every nested jaxpr.

    ``path`` locates the equation: eqn indices interleaved with sub-jaxpr labels such as
    ``(4, "branches[1]", 0)``. ``local name`` is the name without the parent's prefix. Calls
    named in ``groups`` only group equations (see GROUPS).
    """
    namer = Namer() if namer is None else namer
    for i, eqn in enumerate(jaxpr.eqns):
        group = C.call_name(eqn) if groups else None
        group = group if group in groups else None
        base = local_base(eqn) if group is None else group
        name = namer.unique(f"{prefix}/{base}" if prefix else base)
        local = name[len(prefix) + 1 :] if prefix else name
        yield (*path, i), name, local, eqn
        for label, sub in sub_jaxprs(eqn):
            inner = sub.jaxpr if isinstance(sub, C.ClosedJaxpr) else sub
            within = child_prefix(eqn, name, label) if group is None else prefix
            yield from walk_names(inner, within, (*path, i, label), namer, groups)


def equation_names(jaxpr: C.Jaxpr) -> dict[Path, str]:
    return {path: name for path, name, _, _ in walk_names(jaxpr)}
