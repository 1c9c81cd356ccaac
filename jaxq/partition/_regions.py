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
from typing import Any, NoReturn

from jaxq import _compat as C
from jaxq import _names
from jaxq.annotate import compiler_begin_p, compiler_end_p, is_annotation

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


def find_root(parent: list[int], r: int) -> int:
    """Union-find lookup with path compression over a parent list."""
    root = r
    while parent[root] != root:
        root = parent[root]
    while parent[r] != root:
        parent[r], r = root, parent[r]
    return root


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
        self.crossings: dict[int, dict[int, str]] = {}
        """With ``analyze(..., cut=True)``: operands that must leave their region and enter the
        reading equation's anew (equation -> operand position -> that region's compiler)."""

    # union-find over region ids
    def new_region(self, compiler: str) -> int:
        self._parent.append(len(self._parent))
        self.compiler.append(compiler)
        return len(self._parent) - 1

    def find(self, r: int) -> int:
        return find_root(self._parent, r)

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


def analyze(jaxpr: C.Jaxpr, *, cut: bool = False) -> Analysis:
    """Find the regions of ``jaxpr``'s top level; raise :class:`AnnotationError` on bad annotations.

    With ``cut``, an equation reading a region's value and also a value computed from that
    region's results (through its compiler_end) does not join that region, which would make a
    cycle, and the operand is recorded in ``crossings``: the backward pass of an annotated
    function reads the forward region's residuals this way (JAX makes them without an end). The
    analysis is then only good for finding crossings (``acyclic`` in _partition_graph.py writes
    them into the program).
    """
    an = Analysis(jaxpr)
    eqns = jaxpr.eqns
    interior: dict[Any, int] = {}
    # (cut) the regions whose results each value is computed from, through their compiler_end
    exited: dict[Any, frozenset[int]] = {}
    none: frozenset[int] = frozenset()
    after = lambda vs: none.union(*(exited.get(v, none) for v in vs if not C.is_literal(v)))
    kind, region, constvars = an.kind, an.region, an.constvars
    # Equations computing constants (no operands but literals, closed-over constants and other such
    # equations' results) are decided last, from their users: see _settle_constants.
    const_out: dict[Any, int] = {}
    const_eqns: list[int] = []
    pending_ends: list[int] = []
    const_uses: list[tuple[int, Any]] = []  # (member, constant value it reads)
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            an.producer[v] = i
        prim = eqn.primitive
        reads = after(eqn.invars) if cut else none  # (the exits this equation's operands passed)
        through = reads
        if cut and prim is compiler_end_p and eqn.invars[0] in interior:
            through = reads | {an.find(interior[eqn.invars[0]])}
        if through:
            exited.update((v, through) for v in eqn.outvars)
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
            got = None if C.is_literal(x) else interior.get(x)
            if got is None:
                if not C.is_literal(x) and x in const_out:
                    kind[i] = END
                    pending_ends.append(i)
                    continue
                _unbalanced_end(an, i, c)
            r = an.find(got)
            if an.compiler[r] != c:
                raise AnnotationError(
                    f"mismatched annotation: compiler_end for {c!r} at {an.describe(i)} closes a "
                    f"region opened by compiler_begin for {an.compiler[r]!r}."
                )
            kind[i], region[i] = END, r
        else:
            rs: list[int] = []
            outside = None
            consts: list[Any] = []
            seen = {an.find(r) for r in reads}
            for j, a in enumerate(eqn.invars):
                if C.is_literal(a):
                    continue
                got = interior.get(a)
                if got is not None and an.find(got) in seen:  # (it would close a cycle)
                    an.crossings.setdefault(i, {})[j] = an.compiler[an.find(got)]
                elif got is not None:
                    rs.append(an.find(got))
                elif a in const_out:
                    consts.append(a)
                elif a not in constvars and outside is None:
                    outside = a
            if not rs and i in an.crossings:  # (as the region its new begins will make)
                rs.append(an.new_region(next(iter(an.crossings[i].values()))))
            if rs:
                comps = {an.compiler[r] for r in rs}
                if len(comps) > 1:
                    raise AnnotationError(
                        f"mismatched annotations: {an.describe(i)} takes values from regions of "
                        f"different compilers {sorted(comps)}; end one region with compiler_end "
                        "and begin the other with compiler_begin."
                    )
                if outside is not None:
                    _missing_begin(an, i, an.compiler[rs[0]], outside)
                r = rs[0]
                for other in rs[1:]:
                    r = an.union(r, other)
                kind[i], region[i] = MEMBER, r
                for v in eqn.outvars:
                    interior[v] = r
                const_uses.extend((i, v) for v in consts)
            elif outside is None and eqn.outvars and not is_annotation(prim):
                const_eqns.append(i)
                for v in eqn.outvars:
                    const_out[v] = i
    if an.crossings:
        return an
    if const_eqns:
        _settle_constants(an, const_eqns, interior)
    for i in pending_ends:
        x = eqns[i].invars[0]
        got = interior.get(x)
        if got is None:
            _unbalanced_end(an, i, eqns[i].params["compiler"])
        region[i] = an.find(got)
    for i, v in const_uses:
        if v not in interior:
            _missing_begin(an, i, an.compiler[an.find(region[i])], v)
    # Values computed inside a region may leave it only through compiler_end.
    for i, eqn in enumerate(eqns):
        if kind[i] == OUTSIDE:
            for a in eqn.invars:
                if not C.is_literal(a) and a in interior:
                    _escape(an, a, interior, f"{an.describe(i)}")
    for a in jaxpr.outvars:
        if not C.is_literal(a) and a in interior:
            _escape(an, a, interior, "the program's outputs")
    return an


def _settle_constants(an: Analysis, const_eqns: list[int], interior: dict[Any, int]) -> None:
    """A constant-computing equation joins a region when every use of its results is inside that
    one region (or a compiler_end of its compiler); otherwise it stays outside. Visited from the
    last, so chains of them (iota -> convert -> broadcast) settle together."""
    eqns = an.jaxpr.eqns
    wanted = set()
    for i in const_eqns:
        wanted.update(eqns[i].outvars)
    users: dict[Any, list[int]] = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if not C.is_literal(v) and v in wanted:
                users.setdefault(v, []).append(i)
    for i in reversed(const_eqns):
        comp = None
        root = None
        ok = True
        for v in eqns[i].outvars:
            for u in users.get(v, ()):
                k = an.kind[u]
                if k == END:
                    c = eqns[u].params["compiler"]
                elif k == MEMBER:
                    r = an.find(an.region[u])
                    c = an.compiler[r]
                    if root is not None and root != r:
                        ok = False
                    root = r
                else:
                    ok = False
                    break
                if comp is not None and c != comp:
                    ok = False
                comp = c
            if not ok:
                break
        if not ok or comp is None:
            continue
        if root is None:
            root = an.new_region(comp)
        an.kind[i], an.region[i] = MEMBER, root
        for v in eqns[i].outvars:
            interior[v] = root


def _unbalanced_end(an: Analysis, i: int, c: str) -> NoReturn:
    raise AnnotationError(
        f"unbalanced annotation: compiler_end for {c!r} at {an.describe(i)} has no "
        "matching compiler_begin (its operand is not computed inside a region).\n"
        f"Mark the region's inputs with compiler_begin(x, {c!r}), or remove the end."
    )


def _missing_begin(an: Analysis, i: int, c: str, v: Any) -> NoReturn:
    src = an.producer.get(v)
    what = f"the result of {an.describe(src)}" if src is not None else "an input of the program"
    raise AnnotationError(
        f"unbalanced annotation: {an.describe(i)} is inside a region for {c!r} but also uses "
        f"{what}, computed outside it, without compiler_begin; wrap that operand in "
        f"compiler_begin(x, {c!r})."
    )


def _escape(an: Analysis, v: Any, interior: dict[Any, int], where: str) -> NoReturn:
    r = an.find(interior[v])
    c = an.compiler[r]
    src = an.producer.get(v)
    what = f"the result of {an.describe(src)}" if src is not None else f"value {v.aval.str_short()}"
    raise AnnotationError(
        f"unbalanced annotation: {what} is computed inside a region for {c!r} but used by "
        f"{where} without compiler_end; wrap it in compiler_end(x, {c!r})."
    )


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
