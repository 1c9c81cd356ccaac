"""Region analysis of an annotated jaxpr: which equations form the region of which compiler.

A region starts at ``compiler_begin`` equations and ends at ``compiler_end`` equations; every other
equation whose operands come from inside a region belongs to it (operands from several begins of one
compiler join their regions, union-find). Closed-over constants may be used inside a region without a
begin. An equation with no operands but literals and constants whose results only feed
``compiler_end`` of one compiler is a region of its own (``annotate_target`` makes these for ``iota``
and friends). Only the top-level jaxpr is analysed: a nested call is one unit.

Bad annotations raise :class:`AnnotationError` naming the equation.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

from jaxq import _compat as C
from jaxq import _names
from jaxq.annotate import compiler_begin_p, compiler_end_p

OUTSIDE, BEGIN, END, MEMBER = 0, 1, 2, 3


class AnnotationError(ValueError):
    """Unbalanced or mismatched ``compiler_begin`` / ``compiler_end`` annotations."""


class PartitionError(RuntimeError):
    """Regions that cannot be extracted (they would form a cycle)."""


@dataclasses.dataclass
class Region:
    """One region found by :func:`analyze` (indices into the jaxpr's equations, in order)."""

    id: int
    compiler: str
    eqns: list[int]


class Analysis:
    """The result of :func:`analyze`: per-equation kind and region, and the regions in order."""

    def __init__(self, jaxpr: C.Jaxpr) -> None:
        self.jaxpr = jaxpr
        n = len(jaxpr.eqns)
        self.kind = [OUTSIDE] * n
        self.region = [-1] * n
        self._parent: list[int] = []
        self.compiler: list[str] = []
        self.producer: dict[Any, int] = {}
        self.constvars = set(jaxpr.constvars)
        self._names: dict[Any, str] | None = None

    # union-find over region ids
    def new_region(self, compiler: str) -> int:
        self._parent.append(len(self._parent))
        self.compiler.append(compiler)
        return len(self._parent) - 1

    def find(self, r: int) -> int:
        parent = self._parent
        root = r
        while parent[root] != root:
            root = parent[root]
        while parent[r] != root:
            parent[r], r = root, parent[r]
        return root

    def union(self, a: int, b: int) -> int:
        a, b = self.find(a), self.find(b)
        if a != b:
            a, b = min(a, b), max(a, b)
            self._parent[b] = a
        return a

    def name(self, i: int) -> str:
        if self._names is None:
            self._names = _names.equation_names(self.jaxpr)
        return self._names[(i,)]

    def describe(self, i: int) -> str:
        eqn = self.jaxpr.eqns[i]
        return f"equation {i} {self.name(i)!r} ({_short(eqn)})"

    def regions(self) -> list[Region]:
        """The regions, ordered by their first equation."""
        found: dict[int, Region] = {}
        for i, r in enumerate(self.region):
            if r < 0:
                continue
            root = self.find(r)
            reg = found.get(root)
            if reg is None:
                reg = found[root] = Region(root, self.compiler[root], [])
            reg.eqns.append(i)
        return list(found.values())


def _short(eqn: C.JaxprEqn) -> str:
    text = str(eqn).replace("\n", " ")
    return text if len(text) < 120 else text[:117] + "..."


def analyze(jaxpr: C.Jaxpr) -> Analysis:
    """Find the regions of ``jaxpr``'s top level; raise :class:`AnnotationError` on bad annotations."""
    an = Analysis(jaxpr)
    eqns = jaxpr.eqns
    interior: dict[Any, int] = {}
    users: dict[Any, list[int]] | None = None
    kind, region, constvars = an.kind, an.region, an.constvars
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            an.producer[v] = i
        prim = eqn.primitive
        if prim is compiler_begin_p:
            c = eqn.params["compiler"]
            x = eqn.invars[0]
            if not C.is_literal(x) and x in interior:
                r = an.find(interior[x])
                raise AnnotationError(
                    f"compiler_begin for {c!r} at {an.describe(i)} takes a value computed inside a "
                    f"region for {an.compiler[r]!r} with no compiler_end in between.\n"
                    f"Every value leaving a region must pass compiler_end(x, {an.compiler[r]!r}) "
                    "before it enters another region."
                )
            r = an.new_region(c)
            kind[i], region[i] = BEGIN, r
            interior[eqn.outvars[0]] = r
        elif prim is compiler_end_p:
            c = eqn.params["compiler"]
            x = eqn.invars[0]
            r = None if C.is_literal(x) else interior.get(x)
            if r is None:
                raise AnnotationError(
                    f"unbalanced annotation: compiler_end for {c!r} at {an.describe(i)} has no "
                    "matching compiler_begin (its operand is not computed inside a region).\n"
                    f"Mark the region's inputs with compiler_begin(x, {c!r}), or remove the end."
                )
            r = an.find(r)
            if an.compiler[r] != c:
                raise AnnotationError(
                    f"mismatched annotation: compiler_end for {c!r} at {an.describe(i)} closes a "
                    f"region opened by compiler_begin for {an.compiler[r]!r}."
                )
            kind[i], region[i] = END, r
        else:
            rs: list[int] = []
            outside = None
            for v in eqn.invars:
                if C.is_literal(v):
                    continue
                r = interior.get(v)
                if r is not None:
                    rs.append(an.find(r))
                elif v not in constvars and outside is None:
                    outside = v
            if rs:
                comps = {an.compiler[r] for r in rs}
                if len(comps) > 1:
                    raise AnnotationError(
                        f"mismatched annotations: {an.describe(i)} takes values from regions of "
                        f"different compilers {sorted(comps)}; end one region with compiler_end "
                        "and begin the other with compiler_begin."
                    )
                if outside is not None:
                    raise AnnotationError(
                        f"unbalanced annotation: {an.describe(i)} is inside a region for "
                        f"{an.compiler[rs[0]]!r} but also uses {outside} computed outside it without "
                        f"compiler_begin; wrap that operand in compiler_begin(x, "
                        f"{an.compiler[rs[0]]!r})."
                    )
                r = rs[0]
                for other in rs[1:]:
                    r = an.union(r, other)
                kind[i], region[i] = MEMBER, r
                for v in eqn.outvars:
                    interior[v] = r
            elif outside is None and eqn.outvars:
                if users is None:
                    users = _users(eqns)
                c = _only_ends(eqn, eqns, users)
                if c is not None:
                    r = an.new_region(c)
                    kind[i], region[i] = MEMBER, r
                    for v in eqn.outvars:
                        interior[v] = r
    # Values computed inside a region may leave it only through compiler_end.
    for i, eqn in enumerate(eqns):
        if kind[i] == OUTSIDE:
            for v in eqn.invars:
                if not C.is_literal(v) and v in interior:
                    _escape(an, v, interior, f"{an.describe(i)}")
    for v in jaxpr.outvars:
        if not C.is_literal(v) and v in interior:
            _escape(an, v, interior, "the program's outputs")
    return an


def _escape(an: Analysis, v: Any, interior: dict[Any, int], where: str) -> None:
    r = an.find(interior[v])
    c = an.compiler[r]
    src = an.producer.get(v)
    what = f"the result of {an.describe(src)}" if src is not None else f"value {v.aval.str_short()}"
    raise AnnotationError(
        f"unbalanced annotation: {what} is computed inside a region for {c!r} but used by "
        f"{where} without compiler_end; wrap it in compiler_end(x, {c!r})."
    )


def _users(eqns: list[C.JaxprEqn]) -> dict[Any, list[int]]:
    users: dict[Any, list[int]] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not C.is_literal(v):
                users.setdefault(v, []).append(i)
    return users


def _only_ends(eqn: C.JaxprEqn, eqns: list[C.JaxprEqn], users: dict[Any, list[int]]) -> str | None:
    """The compiler whose compiler_end is the only user of every result of ``eqn``, if one is."""
    comp = None
    for v in eqn.outvars:
        if C.is_dropvar(v):
            continue
        us = users.get(v)
        if not us:
            return None
        for u in us:
            e = eqns[u]
            if e.primitive is not compiler_end_p:
                return None
            c = e.params["compiler"]
            if comp is None:
                comp = c
            elif comp != c:
                return None
    return comp


class NodeGraph:
    """The graph of regions (contracted) and outside equations, in flat integer arrays (no container
    per node, so big programs do not wake the garbage collector).

    Node ids are region roots for regions and ``num_regions + i`` for an outside equation ``i``.
    ``parents(k)`` lists the nodes producing node ``k``'s operands; ``order`` is a topological order
    of the nodes (ties broken by program order); ``num_children[k]`` counts distinct child nodes.
    """

    def __init__(
        self,
        node_of: list[int],
        start: list[int],
        flat: list[int],
        order: list[int],
        num_children: list[int],
    ) -> None:
        self.node_of, self._start, self._flat = node_of, start, flat
        self.order, self.num_children = order, num_children

    def parents(self, k: int) -> list[int]:
        return self._flat[self._start[k] : self._start[k + 1]]


def node_graph(an: Analysis) -> NodeGraph:
    """Build the :class:`NodeGraph` of ``an``; raise :class:`PartitionError` if it has a cycle."""
    eqns = an.jaxpr.eqns
    n = len(eqns)
    base = len(an.compiler)
    find = an.find
    node_of = [find(r) if r >= 0 else base + i for i, r in enumerate(an.region)]
    num = base + n
    first = [n] * num
    producer = an.producer
    lit = C.Literal
    seen: set[int] = set()
    ec: list[int] = []
    ep: list[int] = []
    for i, eqn in enumerate(eqns):
        me = node_of[i]
        if i < first[me]:
            first[me] = i
        for v in eqn.invars:
            if isinstance(v, lit):
                continue
            j = producer.get(v)
            if j is None:
                continue
            p = node_of[j]
            if p != me:
                key = me * num + p
                if key not in seen:
                    seen.add(key)
                    ec.append(me)
                    ep.append(p)
    del seen
    indeg = [0] * num
    nch = [0] * num
    for c, p in zip(ec, ep, strict=True):
        indeg[c] += 1
        nch[p] += 1
    pstart = _offsets(indeg)
    cstart = _offsets(nch)
    pflat = [0] * len(ec)
    cflat = [0] * len(ec)
    pfill = pstart[:-1]
    cfill = cstart[:-1]
    for c, p in zip(ec, ep, strict=True):
        pflat[pfill[c]] = p
        pfill[c] += 1
        cflat[cfill[p]] = c
        cfill[p] += 1
    del pfill, cfill, ec, ep
    heap = [first[k] * num + k for k in range(num) if first[k] < n and indeg[k] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        k = heapq.heappop(heap) % num
        order.append(k)
        for ch in cflat[cstart[k] : cstart[k + 1]]:
            indeg[ch] -= 1
            if indeg[ch] == 0:
                heapq.heappush(heap, first[ch] * num + ch)
    present = sum(1 for k in range(num) if first[k] < n)
    if len(order) != present:
        stuck = [k for k in range(num) if first[k] < n and indeg[k] > 0]
        regs = [k for k in stuck if k < base]
        k = regs[0] if regs else stuck[0]
        raise PartitionError(
            f"the regions form a cycle: the region containing {an.describe(first[k])} depends on "
            "its own results through equations outside it. Split the region (end it with "
            "compiler_end before the path leaves it), or run merge_compiler_regions, which never "
            "makes a cycle."
        )
    return NodeGraph(node_of, pstart, pflat, order, nch)


def _offsets(counts: list[int]) -> list[int]:
    out = [0] * (len(counts) + 1)
    total = 0
    for k, c in enumerate(counts):
        out[k] = total
        total += c
    out[-1] = total
    return out
