"""``merge_compiler_regions``: TVM's MergeCompilerRegions on jaxprs.

Regions (and unsupported equations, TVM's "default" regions) are visited in topological order. A
region R absorbs a parent region P of the same compiler unless P is in R's *restriction set*: the
union of its parents' restriction sets plus every parent of another compiler (an unsupported
equation counts as one). A restricted parent reaches R through something outside the compiler, so
merging it would make a cycle. Sibling regions that share only inputs stay apart.

Restriction sets are bitsets (Python ints) over region ids and a merged group is the set of its
members' bits, so "P is restricted" is one ``&``: merging relabels nothing. The pass is linear in
the number of equations plus the total size of the bitsets (zero when no unsupported equation sits
between regions).
"""

from __future__ import annotations

from typing import Any

from jaxq import _compat as C
from jaxq._program import Program
from jaxq.partition._regions import BEGIN, END, analyze, node_graph
from jaxq.transform import Pass, program_pass


def merge_compiler_regions() -> Pass:
    """A pass that merges neighbouring regions of one compiler without ever creating a cycle (the
    compiler_end / compiler_begin pairs between merged regions are removed)."""

    @program_pass(name="merge_compiler_regions")
    def run(program: Program) -> Program:
        closed = program.jaxpr
        jaxpr = closed.jaxpr
        an = analyze(jaxpr)
        base = len(an.compiler)
        if base < 2:
            return program
        node_of, parents, order = node_graph(an)
        group = list(range(base))  # union-find over region roots (merge groups)

        def find(r: int) -> int:
            root = r
            while group[root] != root:
                root = group[root]
            while group[r] != root:
                group[r], r = root, group[r]
            return root

        members = [1 << k for k in range(base)]  # bits of each group's regions
        restrict = [0] * len(parents)  # per node (region root or outside equation)
        for node in order:
            ps = parents[node]
            if not ps:
                continue
            mine = an.compiler[node] if node < base else None
            acc = 0
            same: list[int] = []
            for p in ps:
                if p < base:
                    g = find(p)
                    acc |= restrict[g]
                    if an.compiler[p] == mine:
                        same.append(p)
                    else:
                        acc |= 1 << p
                else:
                    acc |= restrict[p]
            if node >= base:
                restrict[node] = acc
                continue
            me = find(node)
            for p in sorted(same):
                g = find(p)
                if g == me or members[g] & acc:
                    continue
                # merge the parent's group into this region's group
                root, other = (g, me) if g < me else (me, g)
                group[other] = root
                members[root] |= members[other]
                me = root
            restrict[me] = acc
        return _rebuild(program, an, node_of, find, base)

    return run


def _rebuild(program: Program, an: Any, node_of: list[int], find: Any, base: int) -> Program:
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
    live_uses: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        if i in drop_begin:
            continue
        for v in eqn.invars:
            if not C.is_literal(v):
                live_uses[v] = live_uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if not C.is_literal(v):
            live_uses[v] = live_uses.get(v, 0) + 1
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
