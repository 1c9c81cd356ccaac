"""``annotate_target``: wrap every equation a compiler supports in compiler_begin / compiler_end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxq import _compat as C
from jaxq._program import Program
from jaxq.annotate import compiler_begin_p, compiler_end_p
from jaxq.partition._partition_graph import META_KEY as REGIONS_KEY
from jaxq.partition._regions import OUTSIDE, analyze
from jaxq.partition._support import check_compilers, is_supported
from jaxq.transform import Pass, program_pass

_NO_EFFECTS: frozenset[Any] = frozenset()


def annotate_target(compilers: str | Sequence[str]) -> Pass:
    """A pass that marks each top-level equation supported by one of ``compilers`` (the first in the
    list that supports it wins) as a region of its own, as TVM's AnnotateTarget does: a
    ``compiler_begin`` on each distinct operand, a ``compiler_end`` on each result.

    Equations already inside a region (annotated by an earlier run or by hand) and regions
    ``partition_graph`` extracted are left alone (running the pipeline again changes nothing), so
    ``annotate_target(["A"])`` then ``annotate_target(["B"])`` equals ``annotate_target(["A", "B"])``.
    Unsupported equations stay unannotated (TVM's "default" target). A nested call (jit, scan, ...)
    is one unit: see :func:`jaxq.partition.register_op_support` for when it counts as supported.
    """
    targets = check_compilers(compilers, "annotate_target")

    def _run(program: Program) -> Program:
        check_compilers(targets, "annotate_target")  # the registry may have changed since
        closed = program.jaxpr
        jaxpr = closed.jaxpr
        annotated = any(
            e.primitive is compiler_begin_p or e.primitive is compiler_end_p for e in jaxpr.eqns
        )
        kinds = analyze(jaxpr).kind if annotated else None  # skip the analysis when unannotated
        extracted = program.meta.get(REGIONS_KEY, {})  # regions partition_graph made already
        out: list[C.JaxprEqn] = []
        changed = False
        for i, eqn in enumerate(jaxpr.eqns):
            target = None
            if (kinds is None or kinds[i] == OUTSIDE) and C.call_name(eqn) not in extracted:
                at = (i,)
                target = next(
                    (c for c in targets if is_supported(c, eqn, program.equation_at, at)), None
                )
            if target is None:
                out.append(eqn)
                continue
            changed = True
            params = {"compiler": target}
            begun: dict[Any, Any] = {}
            new_in = []
            for v in eqn.invars:
                if C.is_literal(v):
                    new_in.append(v)
                    continue
                b = begun.get(v)
                if b is None:
                    b = begun[v] = C.new_var(v.aval)
                    out.append(
                        C.new_jaxpr_eqn(
                            [v],
                            [b],
                            compiler_begin_p,
                            params,
                            _NO_EFFECTS,
                            eqn.source_info,
                            eqn.ctx,
                        )
                    )
                new_in.append(b)
            new_out = []
            ends = []
            for v in eqn.outvars:
                if C.is_dropvar(v):
                    new_out.append(v)
                    continue
                inner = C.new_var(v.aval)
                new_out.append(inner)
                ends.append(
                    C.new_jaxpr_eqn(
                        [inner],
                        [v],
                        compiler_end_p,
                        params,
                        _NO_EFFECTS,
                        eqn.source_info,
                        eqn.ctx,
                    )
                )
            out.append(eqn.replace(invars=new_in, outvars=new_out))
            out.extend(ends)
        if not changed:
            return program
        return program.with_jaxpr(C.ClosedJaxpr(jaxpr.replace(eqns=out), closed.consts))

    @program_pass(name="annotate_target")
    def run(program: Program) -> Program:
        return _run(program)

    return run
