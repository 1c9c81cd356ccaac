"""The one walker every pass uses.

Two ways to rewrite a program, both recursing into nested jaxprs (jit, scan, cond, while, remat,
custom_jvp_call, custom_vjp_call) and neither mutating its input:

* :func:`rewrite` interprets the program and re-traces it, equation by equation, through a table of
  rules ``primitive name -> rule``. An equation without a rule is re-bound unchanged. Re-tracing
  keeps name stacks and source info (names survive) and lets a rule emit any JAX code.
* :func:`map_equations` rebuilds jaxprs structurally, equation lists in, equation lists out. For
  passes that move equations around without re-tracing them (outlining regions, renaming).

Note: rewriting a custom_jvp/custom_vjp call rewrites its primal body, not its derivative rules.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxq import _compat as C
from jaxq import _names, _warnings
from jaxq._program import EquationView, Program

Path = tuple[Any, ...]


class RewriteError(Exception):
    """A rule failed; the message names the equation it failed on."""


class Visit(EquationView):
    """What a rule sees: one equation of the program being rewritten.

    Attributes:
      name: the equation's stable name (``Dense_0/dot_general``).
      path: where it sits (see :attr:`jaxq.Equation.path`).
    """

    __slots__ = ("eqn", "name", "path", "_walker", "_stack")

    def __init__(self, eqn: C.JaxprEqn, name: str, path: Path, walker: _Walker) -> None:
        self.eqn, self.name, self.path, self._walker = eqn, name, path, walker
        self._stack: Any = None

    @property
    def in_open_body(self) -> bool:
        """Whether this equation sits in a nested jaxpr that is re-bound without constants of its
        own (a loop body on newer JAX): a rule there must not turn values into array constants."""
        return self._walker.open_depth > 0

    @property
    def in_layouts(self) -> tuple[str | None, ...]:
        """The layout of each operand (``"NC"``...), None where unknown or before
        ``infer_layouts``."""
        lay = self._walker.layouts
        return tuple(None if C.is_literal(v) else lay.get(v) for v in self.eqn.invars)

    @property
    def out_layouts(self) -> tuple[str | None, ...]:
        """The layout of each result, None where unknown."""
        return tuple(self._walker.layouts.get(v) for v in self.eqn.outvars)

    def bind(self, *invals: Any, **param_updates: Any) -> Any:
        """Re-bind this equation on ``invals`` (with some params changed), rewriting its nested
        jaxprs with the same rules. Returns what the primitive returns (a list if it has several
        results)."""
        with C.set_name_stack(self._stack):  # the equation's own scope, not the helper scope
            outs = self._walker.default(self, list(invals), {**self.eqn.params, **param_updates})
        return outs if self.eqn.primitive.multiple_results else outs[0]

    def inline(self, *invals: Any) -> Any:
        """Evaluate this call equation's body in place (its equations become the caller's), with
        the same rules: how a pass sees through ``jit`` boundaries, e.g. to find weights."""
        subs = C.subjaxpr_params(self.eqn.params)
        if len(subs) != 1 or subs[0][1] is not None:
            raise RewriteError(f"inline: {self.name!r} ({self.primitive}) is not a call equation")
        with C.set_name_stack(self._stack):
            outs = self.eval_body(subs[0][0], *invals)
        return outs if self.eqn.primitive.multiple_results else outs[0]

    def eval_body(self, key: str, *invals: Any) -> list[Any]:
        """Evaluate the nested jaxpr at param ``key`` (a scan's ``jaxpr``, a cond's
        ``branches[1]``) on ``invals`` with the same rules, inside whatever trace is current: how
        a rule that re-binds a loop itself (``lax.scan`` with a Python body) runs the loop's
        equations. Returns the flat outputs."""
        param, _, index = key.partition("[")
        body = self.eqn.params[param]
        body = C.as_closed(body[int(index[:-1])] if index else body)
        # (under the current name stack: inside a loop's own trace, as in the original body)
        return self._walker.eval(body.jaxpr, body.consts, list(invals), (*self.path, key))

    def own_scope(self, suffix: str = "") -> Any:
        """A context in which JAX code is named like this equation itself (not under the rule's
        helper scope): for a rule that re-binds the equation by other means. With ``suffix``,
        code is named under the equation's own name plus it (a loop's iteration: ``scan@2/``)."""
        if not suffix:
            return C.set_name_stack(self._stack)
        scopes, own = C.stack_scopes(self._stack), self.primitive
        if scopes and _names.is_baked(scopes[-1], own):  # (its own name is the last scope)
            scopes, own = scopes[:-1], scopes[-1]
        return C.set_name_scopes((*scopes, own + suffix))


Rule = Callable[..., Any]
"""``rule(visit, *invals) -> output`` (a sequence of outputs for multiple-result primitives)."""


class _Walker:
    def __init__(
        self,
        rules: Mapping[Any, Rule],
        names: dict[Path, str],
        layouts: Mapping[Any, str],
        recurse: bool,
        scope: str,
        coerce: Callable[[Any], Any] | None = None,
    ) -> None:
        self.rules = {getattr(k, "name", k): r for k, r in rules.items()}
        self.names, self.layouts, self.recurse, self.scope = names, layouts, recurse, scope
        self.coerce = coerce
        self.open_depth = 0

    def retrace(self, closed: C.ClosedJaxpr, path: Path) -> C.ClosedJaxpr:
        def fun(*args: Any) -> list[Any]:
            return self.eval(closed.jaxpr, closed.consts, args, path)

        return C.trace_flat(fun, closed.in_avals)

    def eval(self, jaxpr: C.Jaxpr, consts: Sequence[Any], args: Sequence[Any], path: Path) -> list:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for i, eqn in enumerate(jaxpr.eqns):
            here = (*path, i)
            visit = Visit(eqn, self.names[here], here, self)
            invals = [C.read_atom(v, env) for v in eqn.invars]
            rule = self.rules.get(eqn.primitive.name)
            with C.eqn_context(eqn):
                if rule is None:
                    outs = self.default(visit, invals, eqn.params)
                else:
                    outs = self._apply(rule, visit, invals)
            if len(outs) != len(eqn.outvars):
                raise RewriteError(
                    f"rule for {eqn.primitive.name} at {visit.name!r} returned {len(outs)} "
                    f"outputs; the equation has {len(eqn.outvars)}"
                )
            if rule is not None:
                _check_types(visit, outs)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [C.read_atom(v, env) for v in jaxpr.outvars]

    def _apply(self, rule: Rule, visit: Visit, invals: list[Any]) -> list[Any]:
        visit._stack = C.current_name_stack()
        scopes = C.name_stack_scopes(visit.eqn)
        owner = (
            () if scopes and _names.is_baked(scopes[-1], visit.primitive) else (visit.primitive,)
        )
        try:
            with contextlib.ExitStack() as stack:
                for s in (*owner, self.scope):
                    stack.enter_context(C.extend_name_stack(s))
                out = rule(visit, *invals)
        except RewriteError:
            raise
        except Exception as e:
            raise RewriteError(
                f"rule for {visit.primitive} failed at equation {visit.name!r}: "
                f"{type(e).__name__}: {e}"
            ) from e
        if out is None or (visit.eqn.primitive.multiple_results and any(o is None for o in out)):
            raise RewriteError(
                f"rule for {visit.primitive} at {visit.name!r} returned None; a rule returns "
                "the equation's output (visit.bind(*invals) for the equation as it is): is a "
                "return missing?"
            )
        if visit.eqn.primitive.multiple_results:
            return list(out)
        if isinstance(out, (list, tuple)):
            raise RewriteError(
                f"rule for {visit.primitive} at {visit.name!r} returned a "
                f"{type(out).__name__}; {visit.primitive} has one output, so the rule returns "
                "one array"
            )
        return [out]

    def default(self, visit: Visit, invals: list[Any], params: dict[str, Any]) -> list[Any]:
        eqn = visit.eqn
        if self.coerce is not None:
            invals = [self.coerce(v) for v in invals]
        subs = C.subjaxpr_params(params) if self.recurse else []
        if not subs:
            return C.bind(eqn, invals, params)
        new_params = dict(params)
        remat_body = None
        for key, idx, sub in subs:
            label = key if idx is None else f"{key}[{idx}]"
            opens = C.is_open_param(eqn, sub)
            is_open = opens and eqn.primitive.name not in _REMATS
            self.open_depth += is_open
            try:
                new = self.retrace(C.as_closed(sub), (*visit.path, label))
            finally:
                self.open_depth -= is_open
            if opens:  # open jaxpr param (remat): only if no constants appeared
                if new.consts:
                    remat_body = new
                new = new.jaxpr
            C.replace_param(new_params, key, idx, new)
        if remat_body is not None:
            if eqn.primitive.name not in _REMATS:
                raise RewriteError(
                    f"rewriting {visit.name!r} introduced constants into an open jaxpr param of "
                    f"{eqn.primitive.name}, which jaxq cannot re-bind"
                )
            return C.remat_bind(params, remat_body, invals)
        try:
            return C.bind(eqn, invals, new_params)
        except Exception as e:
            raise RewriteError(
                f"re-binding {eqn.primitive.name} at {visit.name!r} after rewriting its body failed "
                f"(did a rule change the types inside a loop or a branch?): {type(e).__name__}: {e}"
            ) from e


_REMATS = ("remat2", "checkpoint")
"""Primitives whose open jaxpr param jaxq re-binds with new constants (``C.remat_bind``)."""


def _check_types(visit: Visit, outs: Sequence[Any]) -> None:
    """A rule's arrays must have the equation's shapes and dtypes: anything else would silently
    change the program's signature or the types downstream. (A pass's own values, such as a
    quantized weight, are not arrays and are checked where they are consumed.)"""
    for i, (out, var) in enumerate(zip(outs, visit.eqn.outvars, strict=True)):
        shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
        aval: Any = var.aval
        if shape is None or dtype is None or not hasattr(aval, "shape"):
            continue
        if tuple(shape) != tuple(aval.shape) or dtype != aval.dtype:
            raise RewriteError(
                f"rule for {visit.primitive} at {visit.name!r} returned "
                f"{getattr(dtype, 'name', dtype)}{list(shape)} as output {i}; the equation "
                f"produces {aval.str_short()}. A rule must keep each equation's shape and "
                "dtype (cast or reshape inside the rule)."
            )


def misspelled(name: Any, who: str) -> None:
    """Warn when ``name`` is no primitive of JAX's or jaxq's but close to one (``dot_genral``):
    a rule or a support entry keyed by it would never match, silently."""
    from jaxq.annotate import registry  # (the annotations import the walker's package)

    known = C.primitive_names() | {op.name for op in registry()}
    if not isinstance(name, str) or name in known:
        return
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
    if close:
        _warnings.warn(
            f"{who}: no primitive is named {name!r}; did you mean {close[0]!r}? (for a "
            "primitive of your own, pass the Primitive object itself)",
            UserWarning,
        )


def rewrite(
    program: Program, rules: Mapping[Any, Rule], *, recurse: bool = True, scope: str = "rewrite"
) -> Program:
    """Interpret ``program`` and re-trace it through ``rules`` (primitive or its name -> rule).

    Equations a rule emits are named under ``<equation>/<scope>/`` (``Dense_0/dot_general/quantize/
    round``), while the equation it re-binds with ``visit.bind`` keeps its own name: after
    ``name_expressions`` names stay stable through any number of rewrites. A rule keyed by a
    name close to a primitive's (``tanhh``) is warned about.
    """
    for key in rules:
        misspelled(key, "rewrite")
    walker = _Walker(rules, program.names, program.layouts or {}, recurse, scope)
    return program.with_jaxpr(walker.retrace(program.jaxpr, ()))


def interpret(
    program: Program,
    rules: Mapping[Any, Rule],
    *flat_args: Any,
    scope: str = "rewrite",
    coerce: Callable[[Any], Any] | None = None,
) -> list[Any]:
    """Evaluate ``program`` on flat arguments through ``rules`` without re-tracing it, inside
    whatever trace is current (e.g. in ``jax.jit`` to compute statistics). Returns flat outputs.

    ``flat_args`` may hold values of a pass's own types (a quantized weight) that only its rules
    understand; ``coerce`` turns them into arrays wherever an equation without a rule (or the
    program's output) receives one."""
    walker = _Walker(rules, program.names, program.layouts or {}, True, scope, coerce)
    closed = program.jaxpr
    outs = walker.eval(closed.jaxpr, closed.consts, list(flat_args), ())
    return outs if coerce is None else [coerce(v) for v in outs]


def retrace(
    program: Program,
    rules: Mapping[Any, Rule],
    in_avals: Sequence[Any],
    make_inputs: Callable[[Sequence[Any]], Sequence[Any]],
    *,
    scope: str = "rewrite",
    coerce: Callable[[Any], Any] | None = None,
    done: Callable[[], None] | None = None,
) -> C.ClosedJaxpr:
    """Re-trace ``program`` through ``rules`` with a new calling convention: the result takes
    ``in_avals``, and ``make_inputs(flat)`` maps them to the values of the program's inputs (e.g.
    quantized weights in place of float ones). See :func:`interpret` for ``coerce``; ``done()``
    runs as the trace ends (to drop the traced values a pass kept)."""

    def fun(*flat: Any) -> list[Any]:
        try:
            return interpret(program, rules, *make_inputs(flat), scope=scope, coerce=coerce)
        finally:
            if done is not None:
                done()

    return C.trace_flat(fun, list(in_avals))


def map_equations(
    program: Program, fn: Callable[[C.JaxprEqn, Path, str], list[C.JaxprEqn] | None]
) -> Program:
    """Structural rebuild: ``fn(eqn, path, name)`` returns replacement equations (None keeps it).

    Nested jaxprs are rebuilt first, so ``fn`` sees an equation whose params hold the new bodies.
    """
    names = program.names

    def rebuild(jaxpr: C.Jaxpr, path: Path) -> C.Jaxpr:
        eqns: list[C.JaxprEqn] = []
        for i, eqn in enumerate(jaxpr.eqns):
            here = (*path, i)
            subs = C.subjaxpr_params(eqn.params)
            if subs:
                params = dict(eqn.params)
                for key, idx, sub in subs:
                    label = key if idx is None else f"{key}[{idx}]"
                    inner = rebuild(
                        sub.jaxpr if isinstance(sub, C.ClosedJaxpr) else sub, (*here, label)
                    )
                    new = (
                        C.ClosedJaxpr(inner, sub.consts)
                        if isinstance(sub, C.ClosedJaxpr)
                        else inner
                    )
                    C.replace_param(params, key, idx, new)
                eqn = eqn.replace(params=params)
            out = fn(eqn, here, names[here])
            eqns.extend([eqn] if out is None else out)
        return jaxpr.replace(eqns=eqns)

    closed = program.jaxpr
    return program.with_jaxpr(C.ClosedJaxpr(rebuild(closed.jaxpr, ()), closed.consts))
