"""``partition_graph``: extract every region into a named nested ``jit`` call, and ``regions``."""

from __future__ import annotations

import dataclasses
import re
import types
from typing import Any

import jax

from jaxq import _compat as C
from jaxq import _names, _warnings
from jaxq._program import Program
from jaxq.annotate import compiler_begin, compiler_end
from jaxq.partition._regions import (
    BEGIN,
    END,
    Analysis,
    NodeGraph,
    PartitionError,
    analyze,
    node_graph,
)
from jaxq.transform import Pass, program_pass, rewrite

META_KEY = "partition.regions"
"""``program.meta[META_KEY]``: ``{region function name: compiler}`` for every extracted region."""


def partition_graph(*, bind_constants: bool = True, function: str | None = None) -> Pass:
    """A pass that turns each region into a call of a sub-function named
    ``<compiler>_<function>_<index>`` (``function`` defaults to the program's name; indices count
    regions in program order), as TVM's PartitionGraph does.

    * one parameter per distinct value entering the region (duplicated begins are merged);
    * closed-over constants used by the region are bound into it (``bind_constants=False`` passes
      them as parameters instead); literals stay literals;
    * a region may have several results (the call returns them all);
    * the compiler_begin / compiler_end annotations are removed;
    * the equations keep their names (``Dense_0/add``; the region's call is named by its
      function name), so names found before partitioning still find them;
    * an equation that reads a region's value and also a value computed from that region's
      results is not part of it (it would make a cycle): the value leaves the region and enters
      the reader's, as through compiler_end and compiler_begin. So the gradient of an annotated
      function partitions into a forward and a backward region (its backward pass reads the
      forward region's residuals, which JAX makes without an end).

    The compiler of each region is recorded in ``program.meta["partition.regions"]`` and read back
    by :func:`regions`.
    """

    def _run(program: Program) -> Program:
        nested = [
            e.name
            for e in program.equations()
            if e.primitive == "compiler_begin" and len(e.path) > 1
        ]
        if nested:
            _warnings.warn(
                f"partition_graph: {len(nested)} compiler_begin annotation(s) inside nested calls "
                f"or loops ({nested[:3]}) make no region: regions are top-level equations. "
                "Annotate the call as a whole (annotate_target takes a supported call as one "
                "unit), or write the annotations outside it",
                UserWarning,
            )
        program, an, graph = acyclic(program)
        found = an.regions()
        if not found:
            return program
        closed = program.jaxpr
        jaxpr = closed.jaxpr
        fname = function or program.name
        known = dict(program.meta.get(META_KEY, {}))
        start = len(known)
        const_val = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        order = graph.order
        eqns = jaxpr.eqns
        subst: dict[Any, Any] = {}  # outer value -> outer value (duplicate region results)
        calls: dict[int, C.JaxprEqn] = {}
        for k, reg in enumerate(found):
            name = f"{reg.compiler}_{fname}_{start + k}"
            calls[reg.id] = _extract(an, reg.eqns, name, bind_constants, const_val, subst)
            known[name] = reg.compiler
        out: list[C.JaxprEqn] = []
        base = len(an.compiler)
        for node in order:
            # (a region may read another's duplicate result too: the region's own call)
            eqn = calls[node] if node < base else eqns[node - base]
            if subst:
                new = [v if C.is_literal(v) else subst.get(v, v) for v in eqn.invars]
                if any(a is not b for a, b in zip(new, eqn.invars, strict=True)):
                    eqn = eqn.replace(invars=new)
            out.append(eqn)
        outvars = [v if C.is_literal(v) else subst.get(v, v) for v in jaxpr.outvars]
        new_closed = C.ClosedJaxpr(jaxpr.replace(eqns=out, outvars=outvars), closed.consts)
        groups = tuple(dict.fromkeys((*program.meta.get(_names.GROUPS, ()), *known)))
        meta = {**program.meta, META_KEY: types.MappingProxyType(known), _names.GROUPS: groups}
        return program.with_jaxpr(new_closed, meta=types.MappingProxyType(meta))

    @program_pass(name="partition_graph")
    def run(program: Program) -> Program:
        return _run(program)

    return run


def acyclic(program: Program) -> tuple[Program, Analysis, NodeGraph]:
    """``program``'s regions and their graph. Where they form a cycle only because equations
    read a region's values after its results (the backward pass of an annotated function reads
    the forward region's residuals), the program with those operands leaving the region and
    entering the reader's anew (:func:`_cut`): two regions of one compiler, as a user would write
    them. Any other cycle is a :class:`PartitionError`."""
    an = analyze(program.jaxpr.jaxpr)
    try:
        return program, an, node_graph(an)
    except PartitionError:
        crossings = analyze(program.jaxpr.jaxpr, cut=True).crossings
        if not crossings:
            raise
    program = _cut(program, crossings)
    an = analyze(program.jaxpr.jaxpr)
    return program, an, node_graph(an)


def _cut(program: Program, crossings: dict[int, dict[int, str]]) -> Program:
    """``program`` with each crossing operand (``analyze(..., cut=True)``) passed through
    ``compiler_end`` and ``compiler_begin`` of its region's compiler: a value leaving its region
    and entering the reading equation's, as a user would annotate it."""

    def rule(visit: Any, *invals: Any) -> Any:
        cut = crossings.get(visit.path[0]) if len(visit.path) == 1 else None
        if cut:
            invals = tuple(
                compiler_begin(compiler_end(v, cut[j]), cut[j]) if j in cut else v
                for j, v in enumerate(invals)
            )
        return visit.bind(*invals)

    prims = {program.jaxpr.jaxpr.eqns[i].primitive.name for i in crossings}
    return rewrite(program, dict.fromkeys(prims, rule), recurse=False)


def _extract(
    an: Any,
    members: list[int],
    name: str,
    bind_constants: bool,
    const_val: dict[Any, Any],
    subst: dict[Any, Any],
) -> C.JaxprEqn:
    eqns = an.jaxpr.eqns
    inner: dict[Any, Any] = {}  # begin output -> the parameter (or literal) it stands for
    param_of: dict[Any, Any] = {}  # outer value -> inner parameter var
    invars: list[Any] = []  # inner parameters
    outer_in: list[Any] = []  # what the call passes
    constvars: list[Any] = []
    consts: list[Any] = []
    bound: dict[Any, Any] = {}
    body: list[C.JaxprEqn] = []
    result_of: dict[Any, Any] = {}  # inner result -> outer var
    inner_out: list[Any] = []
    outer_out: list[Any] = []

    def const_param(v: Any) -> Any:
        if bind_constants:
            if v not in bound:
                bound[v] = v
                constvars.append(v)
                consts.append(const_val[v])
            return v
        return param(v)

    def param(v: Any) -> Any:
        p = param_of.get(v)
        if p is None:
            p = param_of[v] = C.new_var(v.aval)
            invars.append(p)
            outer_in.append(v)
        return p

    for i in members:
        eqn = eqns[i]
        kind = an.kind[i]
        if kind == BEGIN:
            x = eqn.invars[0]
            if C.is_literal(x):
                inner[eqn.outvars[0]] = x
            elif x in an.constvars:
                inner[eqn.outvars[0]] = const_param(x)
            else:
                inner[eqn.outvars[0]] = param(x)
        elif kind == END:
            x = eqn.invars[0]
            x = inner.get(x, x) if not C.is_literal(x) else x
            y = eqn.outvars[0]
            prev = result_of.get(x) if not C.is_literal(x) else None
            if prev is not None:
                subst[y] = prev
            else:
                if not C.is_literal(x):
                    result_of[x] = y
                inner_out.append(x)
                outer_out.append(y)
        else:
            new = []
            for v in eqn.invars:
                if C.is_literal(v):
                    new.append(v)
                elif v in inner:
                    new.append(inner[v])
                elif v in an.constvars:
                    new.append(const_param(v))
                else:
                    new.append(v)
            if any(a is not b for a, b in zip(new, eqn.invars, strict=True)):
                eqn = eqn.replace(invars=new)
            body.append(eqn)
    sub = C.make_jaxpr(constvars, invars, inner_out, body, name)
    like = eqns[members[0]]
    return C.make_call_eqn(C.ClosedJaxpr(sub, consts), outer_in, outer_out, name, like)


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """A region of a partitioned program (see :func:`regions`).

    Attributes:
      name: the region's function name, ``<compiler>_<function>_<index>``.
      compiler: the compiler the region was partitioned for.
      primitives: the primitive names of the region's equations, in order (a composite shows as
        its pattern name).
      num_inputs: how many arrays the region takes.
      num_outputs: how many arrays it returns.
      index: position of the region's call among the program's top-level equations.
      jaxpr: the region's body, a ClosedJaxpr over flat arrays.
    """

    name: str
    compiler: str
    primitives: tuple[str, ...]
    num_inputs: int
    num_outputs: int
    index: int
    jaxpr: C.ClosedJaxpr = dataclasses.field(repr=False, compare=False)

    @property
    def in_avals(self) -> tuple[Any, ...]:
        """The avals (shape and dtype) of the region's inputs."""
        return tuple(self.jaxpr.in_avals)

    @property
    def out_avals(self) -> tuple[Any, ...]:
        """The avals (shape and dtype) of the region's outputs."""
        return tuple(self.jaxpr.out_avals)

    def program(self) -> Program:
        """The region as a Program of its own, taking and returning flat tuples of arrays (what a
        backend's codegen receives)."""
        n = len(self.jaxpr.in_avals)
        in_tree = jax.tree.structure(((0,) * n, {}))
        out_tree = jax.tree.structure((0,) * len(self.jaxpr.out_avals))
        paths = tuple(f"args[{i}]" for i in range(n))
        return Program(self.jaxpr, in_tree, out_tree, paths, name=self.name)


def regions(program: Program) -> list[RegionInfo]:
    """The regions of a partitioned program, in program order (also inside the device segments
    made by ``plan_devices``). ``primitives`` lists the primitive names of each region's equations;
    a composite shows as its pattern name. ``index`` is the position of the top-level equation
    holding the region."""
    known = program.meta.get(META_KEY)
    pattern = None
    if known is None:
        pattern = re.compile(rf"(?P<c>[^.]+)_{re.escape(program.name)}_\d+")
    out: list[RegionInfo] = []

    def visit(jaxpr: C.Jaxpr, top: int | None) -> None:
        for i, eqn in enumerate(jaxpr.eqns):
            name = C.call_name(eqn)
            if name is None:
                continue
            here = i if top is None else top
            if known is not None:
                compiler = known.get(name)
            else:
                m = pattern.fullmatch(name) if pattern is not None else None
                compiler = m.group("c") if m else None
            sub = C.call_body(eqn)
            if compiler is None:
                visit(sub.jaxpr, here)  # a device segment (or a user's jit) may hold regions
                continue
            out.append(
                RegionInfo(
                    name,
                    compiler,
                    tuple(_label(e) for e in sub.jaxpr.eqns),
                    len(sub.jaxpr.invars),
                    len(sub.jaxpr.outvars),
                    here,
                    sub,
                )
            )

    visit(program.jaxpr.jaxpr, None)
    return out


def _label(eqn: C.JaxprEqn) -> str:
    """A primitive's name; a composite (a jit named ``"<compiler>.<pattern>"``) by its name."""
    name = C.call_name(eqn) or ""
    return name if "." in name else eqn.primitive.name
