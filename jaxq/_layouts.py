"""Layout inference: which axis of each value means what (``NHWC``, ``HWIO``, ``NC``, ...).

Anchors are the equations whose params say it: convolutions (dimension numbers) and dot_general
(contracting and batch dims). Layouts then flow forwards and backwards through equations that keep
axes (elementwise ops, annotations, pooling, slicing), permute them (transpose), add or drop them
(broadcast_in_dim, squeeze, expand_dims, reshapes that only add or drop unit axes, reductions), and
across the boundaries of nested calls. Anything else stays unknown (None): a reshape that merges axes
has no honest layout.

dot_general letters: data operand (lhs) ``B`` batch, ``C`` contracting, ``N T S U`` free axes; weight
operand (rhs) ``B`` batch, ``I`` contracting, ``O P Q`` free; output batch + lhs free + rhs free.
Convolutions: lhs/out ``N C`` + spatial, rhs ``O I`` + spatial, spatial letters ``W``, ``HW``, ``DHW``.
"""

from __future__ import annotations

from typing import Any

from jaxq import _compat as C

_SPATIAL = {1: "W", 2: "HW", 3: "DHW"}
_LHS_FREE, _RHS_FREE, _BATCH = "NTSU", "OPQ", "BGE"
_LHS_CONTRACT, _RHS_CONTRACT = "CKL", "IJM"

_REDUCTIONS = {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "argmax",
    "argmin",
}
_SHAPE_KEEPING_EXCLUDED = {
    "transpose",
    "dot_general",
    "conv_general_dilated",
    "reshape",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "gather",
    "scatter",
    "scatter-add",
    "scatter_add",
    "scatter_mul",
    "scatter_min",
    "scatter_max",
}


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _conv_layouts(eqn: C.JaxprEqn) -> tuple[str, str, str] | None:
    dn = eqn.params["dimension_numbers"]
    nsp = len(dn.lhs_spec) - 2
    if nsp not in _SPATIAL:
        return None
    sp = _SPATIAL[nsp]

    def place(spec: Any, first: str, second: str) -> str:
        letters = [""] * len(spec)
        for letter, dim in zip(first + second + sp, spec, strict=True):
            letters[dim] = letter
        return "".join(letters)

    return place(dn.lhs_spec, "N", "C"), place(dn.rhs_spec, "O", "I"), place(dn.out_spec, "N", "C")


def _dot_layouts(eqn: C.JaxprEqn) -> tuple[str, str, str] | None:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lrank, rrank = (len(_shape(v)) for v in eqn.invars)
    lfree = [d for d in range(lrank) if d not in lc and d not in lb]
    rfree = [d for d in range(rrank) if d not in rc and d not in rb]
    if (
        len(lb) > len(_BATCH)
        or len(lc) > len(_LHS_CONTRACT)
        or len(lfree) > len(_LHS_FREE)
        or len(rfree) > len(_RHS_FREE)
    ):
        return None
    lhs, rhs = [""] * lrank, [""] * rrank
    for k, (a, b) in enumerate(zip(lb, rb, strict=True)):
        lhs[a] = rhs[b] = _BATCH[k]
    for k, (a, b) in enumerate(zip(lc, rc, strict=True)):
        lhs[a], rhs[b] = _LHS_CONTRACT[k], _RHS_CONTRACT[k]
    for k, d in enumerate(lfree):
        lhs[d] = _LHS_FREE[k]
    for k, d in enumerate(rfree):
        rhs[d] = _RHS_FREE[k]
    out = _BATCH[: len(lb)] + _LHS_FREE[: len(lfree)] + _RHS_FREE[: len(rfree)]
    return "".join(lhs), "".join(rhs), out


def _unit_map(src: tuple[int, ...], dst: tuple[int, ...]) -> list[int | None] | None:
    """For a reshape that only adds/drops unit axes: dst axis -> src axis (None for a new unit axis)."""
    if [d for d in src if d != 1] != [d for d in dst if d != 1]:
        return None
    mapping: list[int | None] = []
    i = 0
    for d in dst:
        while i < len(src) and src[i] == 1 and d != 1:
            i += 1
        if d != 1 or i < len(src) and src[i] == 1:
            mapping.append(i)
            i += 1
        else:
            mapping.append(None)
    return mapping


class _Solver:
    def __init__(self) -> None:
        self.lay: dict[C.Var, str] = {}
        self.changed = False

    def get(self, v: Any) -> str | None:
        return None if C.is_literal(v) else self.lay.get(v)

    def set(self, v: Any, layout: str | None) -> None:
        if layout is None or C.is_literal(v) or C.is_dropvar(v) or v in self.lay:
            return
        if len(layout) != len(_shape(v)) or len(set(layout)) != len(layout):
            return
        self.lay[v] = layout
        self.changed = True

    def link(self, a: Any, b: Any) -> None:
        """a and b carry the same axes in the same order."""
        if C.is_literal(a) or C.is_literal(b):
            return
        self.set(a, self.get(b))
        self.set(b, self.get(a))

    # -- one sweep over a jaxpr ---------------------------------------------------------------------
    def sweep(self, jaxpr: C.Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            self.equation(eqn)

    def equation(self, eqn: C.JaxprEqn) -> None:
        prim = eqn.primitive.name
        ins, outs = eqn.invars, eqn.outvars
        if prim == "conv_general_dilated":
            lays = _conv_layouts(eqn)
            if lays:
                for v, layout in zip((ins[0], ins[1], outs[0]), lays, strict=True):
                    self.set(v, layout)
        elif prim == "dot_general":
            lays = _dot_layouts(eqn)
            if lays:
                for v, layout in zip((ins[0], ins[1], outs[0]), lays, strict=True):
                    self.set(v, layout)
        elif prim == "transpose":
            perm = eqn.params["permutation"]
            src, dst = self.get(ins[0]), self.get(outs[0])
            if src:
                self.set(outs[0], "".join(src[p] for p in perm))
            if dst:
                inv = [0] * len(perm)
                for i, p in enumerate(perm):
                    inv[p] = i
                self.set(ins[0], "".join(dst[inv[d]] for d in range(len(perm))))
        elif prim == "broadcast_in_dim":
            dims = eqn.params["broadcast_dimensions"]
            dst = self.get(outs[0])
            if dst:
                self.set(ins[0], "".join(dst[d] for d in dims))
        elif prim in ("squeeze", "reshape", "expand_dims"):
            self._unit_reshape(ins[0], outs[0])
        elif prim in _REDUCTIONS:
            axes = set(eqn.params.get("axes", ()))
            src = self.get(ins[0])
            if src and len(outs) == 1:
                self.set(outs[0], "".join(c for i, c in enumerate(src) if i not in axes))
        elif C.subjaxpr_params(eqn.params):
            self._nested(eqn)
        elif prim not in _SHAPE_KEEPING_EXCLUDED:
            self._shape_keeping(eqn)

    def _unit_reshape(self, a: Any, b: Any) -> None:
        mapping = _unit_map(tuple(_shape(a)), tuple(_shape(b)))
        if mapping is None:
            return
        src, dst = self.get(a), self.get(b)
        if src and None not in mapping:
            self.set(b, "".join(src[m] for m in mapping))  # type: ignore[index]
        if dst:
            back = {m: i for i, m in enumerate(mapping) if m is not None}
            if len(back) == len(_shape(a)):
                self.set(a, "".join(dst[back[d]] for d in range(len(_shape(a)))))

    def _shape_keeping(self, eqn: C.JaxprEqn) -> None:
        """Equations whose array operands all have the output's rank keep axis meaning
        (elementwise ops, annotations, pooling, padding, slicing, concatenation)."""
        if len(eqn.outvars) != 1:
            return
        out = eqn.outvars[0]
        rank = len(_shape(out))
        if rank == 0:
            return
        same = []
        for v in eqn.invars:
            if isinstance(v, C.Literal):
                continue
            r = len(_shape(v))
            if r == rank:
                same.append(v)
            elif r != 0:
                return
        if not same:
            return
        known = self.lay.get(out)
        for v in same:
            known = known or self.lay.get(v)
        if known is not None:
            self.set(out, known)
            for v in same:
                self.set(v, known)

    def _nested(self, eqn: C.JaxprEqn) -> None:
        for key, _, sub in C.subjaxpr_params(eqn.params):
            inner = sub.jaxpr if isinstance(sub, C.ClosedJaxpr) else sub
            pairs_in, pairs_out = C.nested_links(eqn, key, inner)
            for a, b in (*pairs_in, *pairs_out):
                if not C.is_literal(a) and not C.is_literal(b) and _shape(a) == _shape(b):
                    self.link(a, b)
            self.sweep(inner)


def _all_jaxprs(jaxpr: C.Jaxpr) -> list[C.Jaxpr]:
    found = [jaxpr]
    for eqn in jaxpr.eqns:
        for _, _, sub in C.subjaxpr_params(eqn.params):
            found.extend(_all_jaxprs(sub.jaxpr if isinstance(sub, C.ClosedJaxpr) else sub))
    return found


def layout_map(closed: C.ClosedJaxpr, max_sweeps: int = 8) -> dict[C.Var, str]:
    """Layouts of every value of ``closed`` that can be known; iterates sweeps to a fixed point."""
    solver = _Solver()
    for _ in range(max_sweeps):
        solver.changed = False
        solver.sweep(closed.jaxpr)
        # backward information (e.g. a weight's layout from its use) needs reverse sweeps too
        for j in reversed(_all_jaxprs(closed.jaxpr)):
            for eqn in reversed(j.eqns):
                if not C.subjaxpr_params(eqn.params):
                    solver.equation(eqn)
        if not solver.changed:
            break
    return solver.lay
