"""``merge_compiler_regions``: TVM's MergeCompilerRegions on jaxprs.

Regions (and unsupported equations, TVM's "default" regions) are visited in topological order. A
region R absorbs a parent region P of the same compiler unless P is in R's *restriction set*: the
union of its parents' restriction sets plus every parent of another compiler (an unsupported
equation counts as one). A restricted parent reaches R through something outside the compiler, so
merging it would make a cycle. Sibling regions that share only inputs stay apart.

Restriction sets hold region ids and are read through a union-find of merged groups, so merging
relabels nothing; groups that can have no more children are dropped from the sets as they are
built, which keeps them as small as the graph is wide and the pass linear in the equations.
"""

from __future__ import annotations

from collections.abc import Callable
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

    ``restrict[node]`` holds region ids (TVM's restriction set). A group none of whose members has an
    unvisited child can never be asked about again, so it is dropped from the sets as they are
    built ("dead"): the sets stay as small as the graph is wide, and the pass linear.
    """
    base = len(compiler)
    group = list(range(base))

    def find(r: int) -> int:
        return find_root(group, r)

    left = list(graph.num_children)  # unvisited child edges, per group root / outside node
    empty: frozenset[int] = frozenset()
    restrict: list[Any] = [empty] * len(left)
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
        live: set[int] | frozenset[int] = {x for x in acc if left[find(x)] > 0} if acc else empty
        if node < base:
            me = find(node)
            if same:
                blocked = {find(x) for x in live}
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
        for p in ps:  # this node's edges are visited now; forget what can no longer matter
            k = find(p) if p < base else p
            left[k] -= 1
            if not left[k]:
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
