"""``merge_compiler_regions``: TVM's MergeCompilerRegions on jaxprs.

Regions (and unsupported equations, TVM's "default" regions) are visited in topological order. A
region R absorbs a parent region P of the same compiler unless P is in R's *restriction set*: the
union of its parents' restriction sets plus every parent of another compiler (an unsupported
equation counts as one). A restricted parent reaches R through something outside the compiler, so
merging it would make a cycle. Sibling regions that share only inputs stay apart.

Restriction sets hold region ids and are read through a union-find of merged groups, so merging
relabels nothing. They are read transitively (TVM's snapshots are not enough): a group that absorbs
a region takes that region's parents into its set after its descendants took theirs, and a merge
that trusted those stale sets made a cycle (7 of 160 random 22-op graphs). Groups that can have no
more children stand in the sets for their own (frozen) sets, which keeps the sets as small as the
graph is wide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from jaxq import _compat as C
from jaxq._program import Program
from jaxq.partition._partition_graph import acyclic
from jaxq.partition._regions import BEGIN, END, NodeGraph, find_root
from jaxq.transform import Pass, program_pass


def merge_compiler_regions() -> Pass:
    """A pass that merges neighbouring regions of one compiler without ever creating a cycle (the
    compiler_end / compiler_begin pairs between merged regions are removed)."""

    def _run(program: Program) -> Program:
        program, an, graph = acyclic(program)
        base = len(an.compiler)
        if base < 2:
            return program
        find = _merge_groups(an.compiler, graph)
        return _rebuild(program, an, graph.node_of, find)

    @program_pass(name="merge_compiler_regions")
    def run(program: Program) -> Program:
        return _run(program)

    return run


def _merge_groups(compiler: list[str], graph: NodeGraph) -> Callable[[int], int]:
    """Decide the merges; returns ``find`` mapping a region id to its merged group's root.

    ``restrict[node]`` holds region ids (TVM's restriction set), read transitively: a group's own
    set grows when it absorbs a region with parents of its own, after its descendants took their
    sets, so a region's set stands also for the current sets of the groups in it (a merge checks
    the closure). A group none of whose members has an unvisited child is frozen (it can merge no
    more): sets hold it expanded into its own set instead ("dead"), which keeps them as small as
    the graph is wide.
    """
    base = len(compiler)
    group = list(range(base))

    def find(r: int) -> int:
        return find_root(group, r)

    left = list(graph.num_children)  # unvisited child edges, per group root / outside node
    empty: frozenset[int] = frozenset()
    restrict: list[Any] = [empty] * len(left)

    def expand(ids: Iterable[int], alive: bool) -> set[int]:
        """The groups of ``ids`` and, through their sets, every group reaching them through
        another compiler: all of them, or (``alive``) only those not frozen, the frozen ones
        standing for their sets."""
        seen: set[int] = set()
        stack = list(ids)
        while stack:
            g = find(stack.pop())
            if g not in seen:
                seen.add(g)
                if not alive or not left[g]:
                    stack.extend(restrict[g])
        return {g for g in seen if left[g]} if alive else seen

    for node in graph.order:
        ps = graph.parents(node)
        if not ps:
            continue
        mine = compiler[node] if node < base else None
        acc: set[int] = set()
        same: list[int] = []
        for p in ps:
            if p < base:
                acc.update(restrict[find(p)])
                if compiler[p] == mine:
                    same.append(p)
                else:
                    acc.add(p)
            else:
                acc.update(restrict[p])
        live: set[int] | frozenset[int] = expand(acc, alive=True) if acc else empty
        if node < base:
            me = find(node)
            if same:
                blocked = expand(live, alive=False)
                for p in sorted(same):
                    g = find(p)
                    if g == me or g in blocked:
                        continue
                    root, other = (g, me) if g < me else (me, g)
                    group[other] = root
                    left[root] += left[other]
                    me = root
            restrict[me] = live
        else:
            restrict[node] = live
        for p in ps:  # this node's edges are visited now
            k = find(p) if p < base else p
            left[k] -= 1
            if not left[k] and k >= base:  # (an outside node's set is read by its children only)
                restrict[k] = empty
    return find


def _rebuild(program: Program, an: Any, node_of: list[int], find: Callable[[int], int]) -> Program:
    """Drop the begin/end pairs that now sit inside one merged group."""
    jaxpr = program.jaxpr.jaxpr
    eqns = jaxpr.eqns
    subst: dict[Any, Any] = {}
    drop_begin: set[int] = set()
    for i, eqn in enumerate(eqns):
        if an.kind[i] != BEGIN:
            continue
        x = eqn.invars[0]
        if C.is_literal(x):
            continue
        j = an.producer.get(x)
        if j is None or an.kind[j] != END:
            continue
        if find(node_of[j]) == find(node_of[i]):
            drop_begin.add(i)
            subst[eqn.outvars[0]] = eqns[j].invars[0]
    if not drop_begin:
        return program
    # an end whose every use is a dropped begin goes too
    live = (eqn for i, eqn in enumerate(eqns) if i not in drop_begin)
    live_uses = C.use_counts(live, jaxpr.outvars)
    out = []
    for i, eqn in enumerate(eqns):
        if i in drop_begin:
            continue
        if an.kind[i] == END and not live_uses.get(eqn.outvars[0]):
            continue
        if an.kind[i] != BEGIN:
            new = [v if C.is_literal(v) else subst.get(v, v) for v in eqn.invars]
            if any(a is not b for a, b in zip(new, eqn.invars, strict=True)):
                eqn = eqn.replace(invars=new)
        out.append(eqn)
    closed = C.ClosedJaxpr(jaxpr.replace(eqns=out), program.jaxpr.consts)
    return program.with_jaxpr(closed)
