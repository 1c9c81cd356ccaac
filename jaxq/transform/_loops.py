"""Unrolling loops: a ``lax.scan`` of static length becomes its body, once per iteration.

A backend that runs straight-line code (an ONNX Runtime region, a vendor compiler) cannot take a
loop, so a layer stack written with ``nn.scan`` / ``lax.scan`` would stay with XLA whole. Unrolled,
each layer is ordinary equations that partitioning can hand over, and a stacked param bound into
the program is sliced into one constant per layer. The result is the same equations on the same
operands in the same order; compiled straight-line, XLA may fuse them differently from the loop,
so float results can differ in the last bits (integer code is unchanged).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxq import _compat as C
from jaxq._program import Program
from jaxq._walk import Visit, rewrite
from jaxq.transform._pass import Pass, program_pass


def unroll_loops(max_length: int = 64) -> Pass:
    """Replace every ``scan`` of at most ``max_length`` iterations (nested ones too) by its body
    repeated, carries threaded through and ``ys`` stacked; longer scans are left as loops.

    Equations of iteration ``i`` are named under ``<scan>@i/`` (``Model/scan@2/Block/Dense_0/
    dot_general``), as the quantize report keys a scanned layer's iterations."""
    if not isinstance(max_length, int) or max_length < 0:
        raise ValueError(f"unroll_loops: max_length must be an int >= 0; got {max_length!r}")

    def unroll(visit: Visit, *invals: Any) -> Any:
        p = visit.params
        loop = C.scan_loop(p)
        length = int(loop["length"])
        if length > max_length:
            return visit.bind(*invals)
        n_consts, n_carry = C.scan_counts(p)
        consts = invals[:n_consts]
        carry = list(invals[n_consts : n_consts + n_carry])
        xs = invals[n_consts + n_carry :]
        steps = range(length - 1, -1, -1) if loop["reverse"] else range(length)
        per_step: list[list[Any]] = []
        for i in steps:
            with visit.own_scope(f"@{i}"):
                outs = visit.eval_body(C.SCAN_BODY, *consts, *carry, *(_row(x, i) for x in xs))
            carry = outs[:n_carry]
            per_step.append(outs[n_carry:])
        if loop["reverse"]:
            per_step.reverse()
        if not per_step:  # (no iterations: empty ys)
            return [*carry, *(jnp.zeros(a.shape, a.dtype) for a in visit.out_avals[n_carry:])]
        return [*carry, *(jnp.stack(ys) for ys in zip(*per_step, strict=True))]

    @program_pass(name="unroll_loops")
    def run(program: Program) -> Program:
        return rewrite(program, {"scan": unroll}, scope="unroll")

    return run


def _row(x: Any, i: int) -> Any:
    """``x[i]``: sliced now where ``x`` is a constant (a stacked param bound into the program), so
    each iteration gets a constant of its own (a backend sees a layer's weight, not a slice of
    the stack computed at run time)."""
    if C.is_tracer(x):
        return x[i]
    with jax.ensure_compile_time_eval():
        return jnp.asarray(x)[i]
