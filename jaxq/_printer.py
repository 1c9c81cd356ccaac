"""Readable text of a Program: one line per equation with its stable name and layouts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from jaxq import _compat as C
from jaxq import _names

if TYPE_CHECKING:
    from jaxq._program import Program

_MAX_PARAM = 48


class _VarNames:
    def __init__(self) -> None:
        self._names: dict[Any, str] = {}

    def __call__(self, atom: Any) -> str:
        if C.is_literal(atom):
            return _literal(atom.val)
        if C.is_dropvar(atom):
            return "_"
        if atom not in self._names:
            self._names[atom] = _letters(len(self._names))
        return self._names[atom]


def _letters(i: int) -> str:
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(97 + r) + s
    return s


def _literal(val: Any) -> str:
    arr = np.asarray(val)
    return f"{arr.item()!r}" if arr.ndim == 0 else f"<{arr.dtype}{list(arr.shape)}>"


def _param(val: Any) -> str:
    if type(val).__name__ == "ConvDimensionNumbers":
        lhs, rhs, out = val
        return f"{_spec(lhs, 'NC')},{_spec(rhs, 'OI')}->{_spec(out, 'NC')}"
    text = getattr(val, "name", None) if isinstance(val, np.dtype) else None
    text = text or str(val)
    text = " ".join(text.split())
    return text if len(text) <= _MAX_PARAM else text[: _MAX_PARAM - 3] + "..."


def _spec(spec: Any, first: str) -> str:
    letters = [""] * len(spec)
    for letter, dim in zip(first + "DHW"[3 - (len(spec) - 2) :], spec, strict=True):
        letters[dim] = letter
    return "".join(letters)


def _shown(primitive: str, key: str, val: Any) -> bool:
    # jit's sharding/layout/donation params and the rule functions of custom_jvp/vjp calls are
    # noise in a listing; a jit's name identifies regions
    if callable(val) or type(val).__name__ == "WrappedFun":
        return False
    return primitive != "jit" or key == "name"


def _typed(v: Any, names: _VarNames, layouts: Any) -> str:
    lay = layouts.get(v) if layouts else None
    return f"{names(v)}:{v.aval.str_short()}" + (f"@{lay}" if lay else "")


def format_program(program: Program) -> str:
    names = _VarNames()
    lay = program.layouts
    closed = program.jaxpr
    jaxpr = closed.jaxpr
    lines = []
    consts = ", ".join(_typed(v, names, lay) for v in jaxpr.constvars)
    ins = ", ".join(_typed(v, names, lay) for v in jaxpr.invars)
    lines.append(f"program({ins})" + (f" consts({consts})" if consts else "") + ":")
    eqn_names = program.names
    _format_body(jaxpr, (), eqn_names, names, lay, "  ", lines)
    return "\n".join(lines)


def _format_body(jaxpr, path, eqn_names, names, lay, indent, lines) -> None:
    for i, eqn in enumerate(jaxpr.eqns):
        here = (*path, i)
        subs = _names.sub_jaxprs(eqn)
        sub_keys = {label.partition("[")[0] for label, _ in subs}
        params = " ".join(
            f"{k}={_param(v)}"
            for k, v in eqn.params.items()
            if k not in sub_keys and v is not None and _shown(eqn.primitive.name, k, v)
        )
        head = eqn.primitive.name + (f"[{params}]" if params else "")
        outs = " ".join(_typed(v, names, lay) for v in eqn.outvars)
        ins = " ".join(names(v) for v in eqn.invars)
        lines.append(f"{indent}{outs} = {head} {ins}".rstrip() + f"    # {eqn_names[here]}")
        for label, sub in subs:
            inner = sub.jaxpr if isinstance(sub, C.ClosedJaxpr) else sub
            binders = " ".join(_typed(v, names, lay) for v in (*inner.constvars, *inner.invars))
            lines.append(f"{indent}  {label}({binders}):")
            _format_body(inner, (*here, label), eqn_names, names, lay, indent + "    ", lines)
            ret = " ".join(names(v) for v in inner.outvars)
            lines.append(f"{indent}    return {ret}")
    if not path:
        lines.append(f"{indent}return " + " ".join(names(v) for v in jaxpr.outvars))
