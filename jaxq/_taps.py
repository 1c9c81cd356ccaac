"""Taps: read the values of named equations, compiled, for per-layer numerics (SQNR, debugging).

``intermediates(program, names, *args)`` adds the chosen equations' results as extra outputs of
the jaxpr (a structural change: nothing is re-traced, nothing else moves), jits it, and returns them
by name. Only equations of the top-level jaxpr can be tapped: values inside loops or branches have
no single value to return.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

from jaxq import _compat as C
from jaxq._program import Program


def intermediates(program: Program, names: str | Iterable[str], *args: Any, **kwargs: Any) -> dict:
    """``{name: first result of that equation}`` for each of ``names`` (one name, or several),
    evaluated on ``args``."""
    wanted = list(dict.fromkeys([names] if isinstance(names, str) else names))
    by_name = {e.name: e for e in program.equations()}
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise KeyError(f"intermediates: no equation named {missing[:3]}; see program.equations()")
    nested = [n for n in wanted if len(by_name[n].path) != 1]
    if nested:
        raise ValueError(
            f"intermediates: {nested[:3]} are inside nested jaxprs (jit, scan, cond...); only "
            "top-level equations can be tapped"
        )
    empty = [n for n in wanted if not by_name[n].eqn.outvars]
    if empty:
        raise ValueError(
            f"intermediates: {empty[:3]} have no result to tap (equations run only for an "
            "effect, such as debug_print)"
        )
    closed = program.jaxpr
    taps = [by_name[n].eqn.outvars[0] for n in wanted]
    jaxpr = closed.jaxpr.replace(outvars=[*closed.jaxpr.outvars, *taps])
    run = C.jaxpr_as_fun(C.ClosedJaxpr(jaxpr, closed.consts))
    n_out = len(closed.jaxpr.outvars)

    @jax.jit
    def tapped(flat: list[Any]) -> list[Any]:
        return run(*flat)[n_out:]

    values = tapped(program.flatten_args(args, kwargs))
    return dict(zip(wanted, values, strict=True))
