"""Structural passes every pipeline builds on: identity rewrite, naming, layouts."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jaxq import _compat as C
from jaxq._layouts import layout_map
from jaxq._program import Program
from jaxq._walk import map_equations, rewrite
from jaxq.transform._pass import Pass, program_pass


def identity() -> Pass:
    """Interpret and re-trace the program unchanged (the walker with no rules)."""

    @program_pass(name="identity")
    def run(program: Program) -> Program:
        return rewrite(program, {})

    return run


def name_expressions() -> Pass:
    """Give every equation its stable, unique name for good (MSC-style naming).

    Names come from the name stack (``CNN/Dense_0/dot_general``), with a suffix only where needed
    (``.../add_1``). Baking them into the name stacks keeps them fixed through later passes that add
    equations, and carries them into XLA's op metadata, so profiles map back to them.
    """

    @program_pass(name="name_expressions")
    def run(program: Program) -> Program:
        local = {path: loc for path, _, loc, _ in program.walk_names()}

        def bake(eqn: C.JaxprEqn, path: tuple, name: str) -> list[C.JaxprEqn]:
            return [C.with_name_stack(eqn, tuple(local[path].split("/")))]

        return map_equations(program, bake)

    return run


def infer_layouts() -> Pass:
    """Attach the layout of every value that can be known: which axis of each value means what
    (``NHWC``, ``HWIO``, ``NC``...), in ``program.layouts``, printed with the IR and passed to
    rules as ``visit.in_layouts`` / ``visit.out_layouts``.

    Anchors are the equations whose params say it: convolutions (dimension numbers) and
    ``dot_general`` (contracting and batch dims). Layouts then flow forwards and backwards through
    equations that keep axes (elementwise ops, annotations, pooling, slicing), permute them
    (transpose), add or drop them (``broadcast_in_dim``, ``squeeze``, ``expand_dims``, reshapes
    that only add or drop unit axes, reductions), and across the boundaries of nested calls.
    Anything else stays unknown (None): a reshape that merges axes has no honest layout.

    ``dot_general`` letters: data operand (lhs) ``B`` batch, ``C`` contracting, ``N T S U`` free
    axes; weight operand (rhs) ``B`` batch, ``I`` contracting, ``O P Q`` free; output batch + lhs
    free + rhs free. Convolutions: lhs/out ``N C`` + spatial, rhs ``O I`` + spatial, spatial
    letters ``W``, ``HW``, ``DHW``.
    """

    @program_pass(name="infer_layouts")
    def run(program: Program) -> Program:
        return program.replace(layouts=layout_map(program.jaxpr))

    return run


def strip_annotations(keep: str | Iterable[str] = (), *, barriers: bool = False) -> Pass:
    """Remove identity annotations (``on_device``, ``compiler_begin``/``end``, ``cast_hint``) before
    codegen, except those named in ``keep``.

    ``stop_fusion`` is a fusion barrier meant to reach XLA, so it stays unless ``barriers=True``.
    ``simulated_quantize`` computes a value and is never stripped: realize it with
    ``jaxq.quantize.realize`` instead.
    """
    # Annotations sit above the passes in the import order; the registry is read when the pass runs.
    from jaxq.annotate import IDENTITY_ANNOTATIONS, registry

    keep = frozenset([keep] if isinstance(keep, str) else keep) | (
        frozenset() if barriers else {"stop_fusion"}
    )
    known = {op.name for op in registry()}
    unknown = sorted(keep - known)
    if unknown:
        raise ValueError(
            f"strip_annotations: unknown annotation(s) {unknown} in keep; known: {sorted(known)}"
        )
    rules = {p.name: _forward for p in IDENTITY_ANNOTATIONS if p.name not in keep}

    @program_pass(name="strip_annotations")
    def run(program: Program) -> Program:
        return rewrite(program, rules, scope="strip")

    return run


def _forward(visit: object, x: object) -> object:
    return x


def fold_constants(max_elements: int = 4096) -> Pass:
    """Evaluate every equation whose inputs are all constants (TVM's ``FoldConstant``), where its
    results hold at most ``max_elements`` elements each.

    Scale arithmetic on constant params (an activation scale times a weight scale, a zero point's
    dtype) then reaches a backend as one constant instead of equations of its own; results larger
    than ``max_elements`` (a weight dequantized to float) stay computed at run time, so the program
    does not grow by a copy of the model. A ``select_n`` whose predicate is a constant in its own
    body and picks one case is that case (not where the predicate comes from an argument of a
    ``jit`` call, as in ``jnp.var``'s ``where(n - ddof > 0, ...)``: call arguments are not
    propagated into bodies, which are kept as they are). Equations with effects and
    sub-programs (jit, scan, ...) are left as they are; their equations are folded inside, except
    in bodies that JAX re-binds without constants of their own (``scan`` / ``while`` bodies on
    newer JAX). Annotations (``on_device``, ``stop_fusion``, ``simulated_quantize``, ...) are
    kept, on folded operands: later passes read them.

    Each folded value is computed by XLA on its own, as the equation it replaces: a folded
    reduction may round differently (in the last bits) from the same reduction compiled together
    with the rest of the program, as with XLA's own constant folding.
    """
    if not isinstance(max_elements, int) or max_elements < 0:
        raise ValueError(f"fold_constants: max_elements must be an int >= 0; got {max_elements!r}")

    def fold(visit: Any, *invals: Any) -> Any:
        eqn = visit.eqn
        small = all(math.prod(v.aval.shape) <= max_elements for v in eqn.outvars)
        if visit.in_open_body:  # (a loop body re-bound without constants: left as it is)
            return visit.bind(*invals)
        if eqn.primitive.name == "select_n" and not C.is_tracer(invals[0]):
            which = np.asarray(invals[0])
            if which.size and (which == which.flat[0]).all():  # (one case chosen: that case)
                return invals[1 + int(which.flat[0])]
        if invals and small and not eqn.effects and not any(C.is_tracer(v) for v in invals):
            with jax.ensure_compile_time_eval():
                return visit.bind(*invals)
        return visit.bind(*invals)

    @program_pass(name="fold_constants")
    def run(program: Program) -> Program:
        from jaxq.annotate import is_annotation

        prims = {
            e.primitive
            for e in program.equations()
            if not C.subjaxpr_params(e.params) and not is_annotation(e.eqn.primitive)
        }
        return rewrite(program, {p: fold for p in prims}, scope="fold")

    return run
