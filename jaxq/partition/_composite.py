"""``merge_composite``: group patterns of equations (conv + bias + relu...) into composite functions.

The pattern language and the matching rules: :func:`merge_composite`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxq import _compat as C
from jaxq._program import Equation, Program
from jaxq.transform import Pass, program_pass


class Pattern:
    """A pattern over values of a jaxpr; combine with ``|`` and :meth:`optional`."""

    def __or__(self, other: Pattern) -> Pattern:
        return Alt(self, _check_pattern(other, "|"))

    def optional(self, extend: Callable[[Pattern], Pattern]) -> Pattern:
        """``extend(self)`` if it matches, else ``self`` (TVM's ``pattern.optional``)."""
        return Alt(_check_pattern(extend(self), "optional"), self)


@dataclasses.dataclass(frozen=True, eq=False)
class Wildcard(Pattern):
    def __repr__(self) -> str:
        return "wildcard()"


@dataclasses.dataclass(frozen=True, eq=False)
class Constant(Pattern):
    def __repr__(self) -> str:
        return "is_constant()"


@dataclasses.dataclass(frozen=True, eq=False)
class Op(Pattern):
    primitive: str
    operands: tuple[Pattern, ...] | None
    params: tuple[tuple[str, Any], ...] = ()
    where: Callable[[Equation], bool] | None = None

    def __repr__(self) -> str:
        ops = "" if self.operands is None else ", ".join(map(repr, self.operands))
        return f"is_op({self.primitive!r})({ops})"


@dataclasses.dataclass(frozen=True, eq=False)
class Alt(Pattern):
    left: Pattern
    right: Pattern

    def __repr__(self) -> str:
        return f"({self.left!r} | {self.right!r})"


def wildcard() -> Pattern:
    """Any value."""
    return Wildcard()


_CONSTANT_LAYOUT = ("broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "expand_dims")
"""Equations of a constant that :func:`is_constant` sees through (they stay outside the match)."""


def is_constant() -> Pattern:
    """A literal or a closed-over constant, also reshaped, broadcast or cast (a bias ``b`` of
    ``conv(x) + b`` reaches the add broadcast)."""
    return Constant()


def is_op(
    primitive: Any, where: Callable[[Equation], bool] | None = None, **params: Any
) -> Callable[..., Pattern]:
    """``is_op("add")(p, q)``: an equation of ``primitive`` whose operands match ``p``, ``q``."""
    name = getattr(primitive, "name", primitive)
    if not isinstance(name, str):
        raise TypeError(f"is_op: primitive must be a name or a Primitive; got {primitive!r}")

    def build(*operands: Pattern) -> Pattern:
        ops = tuple(_check_pattern(o, f"is_op({name!r})") for o in operands)
        return Op(name, ops or None, tuple(sorted(params.items())), where)

    return build


def _check_pattern(p: Any, where: str) -> Pattern:
    if not isinstance(p, Pattern):
        raise TypeError(f"{where}: expected a pattern (is_op, wildcard, is_constant); got {p!r}")
    return p


@dataclasses.dataclass(frozen=True)
class Match:
    """What a pattern's ``check`` receives.

    Attributes:
      name: the pattern's name in the table (``"dnnl.conv_bias_relu"``).
      equations: the matched equations, in program order (the last is the root).
    """

    name: str
    equations: tuple[Equation, ...]

    @property
    def root(self) -> Equation:
        """The equation whose result the match computes (the last one)."""
        return self.equations[-1]


class _State:
    __slots__ = ("memo", "eqns")

    def __init__(self, memo: dict[int, Any], eqns: set[int]) -> None:
        self.memo, self.eqns = memo, eqns

    def copy(self) -> _State:
        return _State(dict(self.memo), set(self.eqns))


class _Matcher:
    def __init__(self, program: Program, claimed: set[int]) -> None:
        self.program = program
        jaxpr = self.jaxpr = program.jaxpr.jaxpr
        self.constvars = set(jaxpr.constvars)
        self.claimed = claimed
        self.producer: dict[Any, int] = {}
        for i, e in enumerate(jaxpr.eqns):
            for v in e.outvars:
                self.producer[v] = i

    def match(self, p: Pattern, atom: Any, st: _State) -> _State | None:
        key = id(p)
        if key in st.memo:
            same = st.memo[key]
            ok = atom is same or (
                C.is_literal(atom) and C.is_literal(same) and atom.val is same.val
            )
            return st if ok else None
        if isinstance(p, Alt):
            got = self.match(p.left, atom, st.copy())
            return got if got is not None else self.match(p.right, atom, st)
        if isinstance(p, Wildcard):
            ok = True
        elif isinstance(p, Constant):
            ok = self._constant(atom)
        else:
            assert isinstance(p, Op)
            matched = self._match_op(p, atom, st)
            if matched is None:
                return None
            st, ok = matched, True
        if not ok:
            return None
        st.memo[key] = atom
        return st

    def _constant(self, atom: Any) -> bool:
        """A literal, a closed-over constant, or one reshaped, broadcast or cast (a bias ``b``
        of ``x + b`` reaches the add through ``broadcast_in_dim``)."""
        if C.is_literal(atom) or atom in self.constvars:
            return True
        i = self.producer.get(atom)
        if i is None:
            return False
        eqn = self.jaxpr.eqns[i]
        return eqn.primitive.name in _CONSTANT_LAYOUT and all(self._constant(v) for v in eqn.invars)

    def _match_op(self, p: Op, atom: Any, st: _State) -> _State | None:
        if C.is_literal(atom):
            return None
        i = self.producer.get(atom)
        if i is None or i in self.claimed:
            return None
        eqn = self.jaxpr.eqns[i]
        if eqn.primitive.name != p.primitive:
            return None
        for k, v in p.params:
            if k not in eqn.params or eqn.params[k] != v:
                return None
        if p.where is not None and not p.where(self.program.equation_at((i,), eqn)):
            return None
        st.eqns.add(i)
        if p.operands is None:
            return st
        if len(p.operands) != len(eqn.invars):
            return None
        for sub, a in zip(p.operands, eqn.invars, strict=True):
            got = self.match(sub, a, st)
            if got is None:
                return None
            st = got
        return st


Table = Sequence[tuple[str, Pattern] | tuple[str, Pattern, Callable[[Match], bool] | None]]


def merge_composite(patterns: Table) -> Pass:
    """A pass that turns every match of ``patterns`` (``(name, pattern, check=None)``, tried in
    order) into a composite function: a nested ``jit`` named ``name``.

    The pattern language, over the top-level equations of a program::

        x, w, b = wildcard(), wildcard(), is_constant()
        conv = is_op("conv_general_dilated")(x, w)   # primitive match, operands matched in order
        relu = lambda p: is_op("max")(p, is_constant())
        pat = is_op("add")(conv, b).optional(relu)    # conv + bias, with an optional relu
        alt = is_op("tanh")(x) | is_op("logistic")(x)  # alternatives (left first)
        merge_composite([("dnnl.conv_bias_relu", pat, None), ("dnnl.act", alt, None)])

    * ``is_op(name, where=None, **params)(*operands)``: an equation of primitive ``name`` whose
      params equal ``params`` and for which ``where(record)`` holds; operands matched position by
      position (``is_op(name)()`` with no operands leaves them free);
    * ``wildcard()``: any value; ``is_constant()``: a literal or a closed-over constant (also
      reshaped, broadcast or cast: a bias as ``x + b`` adds it);
    * ``jax.nn.relu`` traces as a ``custom_jvp_call`` (``is_op("custom_jvp_call")(p)`` matches
      it), ``jnp.maximum(x, 0.0)`` as the ``max`` above;
    * ``p | q``: ``p``, else ``q``; ``p.optional(f)``: ``f(p)``, else ``p``;
    * using one pattern object twice means the *same* value both times (a diamond:
      ``r = is_op("sin")(x); is_op("add")(r, r)`` does not match ``sin(a) + sin(b)``; TVM PR
      5552).

    Patterns are tried in table order; for each pattern, roots are tried from the last equation
    back, so the largest match wins. A match is rejected when it overlaps an earlier match, when a
    value computed inside it (other than at its root) is used outside it, or when
    ``check(match)`` is false. A match becomes a nested ``jit`` named after the pattern; a name
    ``"<compiler>.<rest>"`` makes ``annotate_target`` give the composite, as one unit, to that
    compiler.
    """
    table = []
    for entry in patterns:
        if not isinstance(entry, tuple) or len(entry) not in (2, 3):
            raise TypeError(
                f"merge_composite: each entry is (name, pattern) or (name, pattern, check); got "
                f"{entry!r}"
            )
        name, pat, check = (*entry, None)[:3]
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"merge_composite: a pattern name must be a non-empty string; got {name!r}"
            )
        if not isinstance(pat, Op) and not (isinstance(pat, Alt)):
            raise TypeError(
                f"merge_composite: pattern {name!r} must be rooted at an operation (is_op(...)); "
                f"got {pat!r}"
            )
        table.append((name, pat, check))

    def _run(program: Program) -> Program:
        for name, pat, check in table:
            program = _apply(program, name, pat, check)
        return program

    @program_pass(name="merge_composite")
    def run(program: Program) -> Program:
        return _run(program)

    return run


def _apply(
    program: Program, name: str, pat: Pattern, check: Callable[[Match], bool] | None
) -> Program:
    closed = program.jaxpr
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    claimed: set[int] = set()
    m = _Matcher(program, claimed)
    users: dict[Any, set[int]] = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if not C.is_literal(v):
                users.setdefault(v, set()).add(i)
    outs = {v for v in jaxpr.outvars if not C.is_literal(v)}
    groups: dict[int, list[int]] = {}  # root -> members
    for i in range(len(eqns) - 1, -1, -1):
        if i in claimed or not eqns[i].outvars:
            continue
        st = m.match(pat, eqns[i].outvars[0], _State({}, set()))
        if st is None or i not in st.eqns:
            continue
        members = sorted(st.eqns)
        if any(j in claimed for j in members):
            continue
        inside = set(members)
        escapes = any(
            v in outs or not users.get(v, set()) <= inside
            for j in members
            if j != i
            for v in eqns[j].outvars
        )
        if escapes or max(members) != i:
            continue
        if check is not None:
            recs = tuple(program.equation_at((j,), eqns[j]) for j in members)
            if not check(Match(name, recs)):
                continue
        claimed.update(members)
        groups[i] = members
    if not groups:
        return program
    out: list[C.JaxprEqn] = []
    for i, e in enumerate(eqns):
        if i in groups:
            out.append(_outline([eqns[j] for j in groups[i]], name))
        elif i not in claimed:
            out.append(e)
    return program.with_jaxpr(C.ClosedJaxpr(jaxpr.replace(eqns=out), closed.consts))


def _outline(members: list[C.JaxprEqn], name: str) -> C.JaxprEqn:
    defined: set[Any] = set()
    param: dict[Any, Any] = {}
    inner_in: list[Any] = []
    outer_in: list[Any] = []
    body = []
    for e in members:
        new = []
        for v in e.invars:
            if C.is_literal(v) or v in defined:
                new.append(v)
                continue
            if v not in param:
                param[v] = C.new_var(v.aval)
                inner_in.append(param[v])
                outer_in.append(v)
            new.append(param[v])
        body.append(
            e.replace(invars=new)
            if any(a is not b for a, b in zip(new, e.invars, strict=True))
            else e
        )
        defined.update(e.outvars)
    root = members[-1]
    inner_out = [v for v in root.outvars if not C.is_dropvar(v)]
    outer_out = [C.new_var(v.aval) for v in inner_out]
    # keep the root's variables outside (consumers refer to them): swap them in
    ren = dict(zip(inner_out, outer_out, strict=True))
    body[-1] = body[-1].replace(outvars=[ren.get(v, v) for v in body[-1].outvars])
    sub = C.make_jaxpr([], inner_in, outer_out, body, name)
    return C.make_call_eqn(C.ClosedJaxpr(sub, []), outer_in, inner_out, name, root)
