"""Every touch of JAX internals, in one place.

jaxq's IR is the jaxpr, whose classes and tracing helpers are only partly public. Everything jaxq needs
beyond the public API is imported or wrapped here, so moving to a newer JAX (0.11+ merges ClosedJaxpr
into Jaxpr and changes scan's params) is a change to this module alone.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
from jax._src import source_info_util as _siu
from jax.extend import core as jcore

ClosedJaxpr = jcore.ClosedJaxpr
Jaxpr = jcore.Jaxpr
JaxprEqn = jcore.JaxprEqn
Literal = jcore.Literal
Var = jcore.Var
DropVar = jcore.DropVar
Primitive = jcore.Primitive
check_jaxpr = jcore.check_jaxpr
jaxpr_as_fun = jcore.jaxpr_as_fun
new_jaxpr_eqn = jcore.new_jaxpr_eqn
NameStack = _siu.NameStack

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def name_stack_scopes(eqn: JaxprEqn) -> tuple[str, ...]:
    """The equation's name stack as plain strings (transforms like ``jvp(...)`` wrap their scopes)."""
    return _scopes(eqn.source_info.name_stack)


@functools.lru_cache(maxsize=8192)
def _scopes(stack: NameStack) -> tuple[str, ...]:
    # equations of one scope share a name stack: formatting it once per stack keeps naming linear
    text = str(stack)
    return tuple(text.split("/")) if text else ()


def with_name_stack(eqn: JaxprEqn, scopes: tuple[str, ...]) -> JaxprEqn:
    """A copy of ``eqn`` whose name stack is exactly ``scopes``."""
    return eqn.replace(source_info=eqn.source_info.replace(name_stack=_stack_of(scopes)))


def stack_scopes(stack: NameStack) -> tuple[str, ...]:
    """A name stack as plain strings."""
    return _scopes(stack)


def _stack_of(scopes: tuple[str, ...]) -> NameStack:
    stack = NameStack()
    for s in scopes:
        stack = stack.extend(s)
    return stack


def set_name_scopes(scopes: tuple[str, ...]) -> Any:
    """Context manager: make the plain strings ``scopes`` the absolute name stack."""
    return _siu.set_name_stack(_stack_of(scopes))


@contextlib.contextmanager
def eqn_context(eqn: JaxprEqn) -> Iterator[None]:
    """Re-enter the source info (name stack, traceback) and context of ``eqn`` while re-binding it.

    This is what keeps names and source locations through an interpret-and-retrace rewrite, exactly as
    ``jax.core.eval_jaxpr`` does.
    """
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        yield


def current_name_stack() -> NameStack:
    return _siu.current_name_stack()


def set_name_stack(stack: NameStack) -> Any:
    """Context manager: make ``stack`` the absolute name stack."""
    return _siu.set_name_stack(stack)


def extend_name_stack(scope: str) -> Any:
    """Context manager: push one scope onto the current name stack."""
    return _siu.extend_name_stack(scope)


def bind(eqn: JaxprEqn, invals: list[Any], params: dict[str, Any]) -> list[Any]:
    """Bind ``eqn``'s primitive on ``invals`` with ``params``; always returns a list of outputs."""
    prim = eqn.primitive
    out = prim.bind(*invals, **prim.get_bind_params(params))
    return list(out) if prim.multiple_results else [out]


def read_atom(atom: Any, env: dict[Var, Any]) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


def is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def use_counts(eqns: Iterable[JaxprEqn], outvars: Iterable[Any]) -> dict[Var, int]:
    """How many times each variable is read by ``eqns`` and ``outvars`` (literals aside)."""
    uses: dict[Var, int] = {}
    for atoms in (*(e.invars for e in eqns), outvars):
        for v in atoms:
            if not is_literal(v):
                uses[v] = uses.get(v, 0) + 1
    return uses


def is_dropvar(atom: Any) -> bool:
    return isinstance(atom, DropVar)


def trace_flat(fun: Any, in_avals: list[Any]) -> ClosedJaxpr:
    """Trace ``fun(*flat_args) -> list`` at the given avals into a ClosedJaxpr."""
    specs = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
        for a in in_avals
    ]
    return jax.make_jaxpr(fun)(*specs)


def remat_bind(params: dict[str, Any], inner: ClosedJaxpr, invals: list[Any]) -> list[Any]:
    """Re-create a ``checkpoint`` (remat) call around a rewritten body.

    remat's ``jaxpr`` param is an open Jaxpr, so a body that gained constants cannot be bound directly;
    the public ``jax.checkpoint`` closes over them for us.
    """
    return list(remat_like(params, jaxpr_as_fun(inner))(*invals))


def remat_like(params: dict[str, Any], fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` under ``jax.checkpoint`` as a ``checkpoint`` equation with ``params`` asks (its
    policy, its ``prevent_cse``)."""
    return jax.checkpoint(fun, prevent_cse=params["prevent_cse"], policy=params["policy"])


def subjaxpr_params(params: dict[str, Any]) -> list[tuple[str, int | None, Any]]:
    """``(key, index, jaxpr)`` for every nested jaxpr in ``params`` (index set for tuples of jaxprs,
    including namedtuples such as custom_linear_solve's, whose empty slots are None)."""
    found: list[tuple[str, int | None, Any]] = []
    for key, val in params.items():
        if isinstance(val, (Jaxpr, ClosedJaxpr)):
            found.append((key, None, val))
        elif (
            isinstance(val, tuple)
            and any(isinstance(v, (Jaxpr, ClosedJaxpr)) for v in val)
            and all(v is None or isinstance(v, (Jaxpr, ClosedJaxpr)) for v in val)
        ):
            found.extend((key, i, v) for i, v in enumerate(val) if v is not None)
    return found


def replace_param(params: dict[str, Any], key: str, index: int | None, new: Any) -> None:
    """Put ``new`` at ``params[key]`` (or its ``index``-th slot, keeping the tuple's type)."""
    if index is None:
        params[key] = new
        return
    old = params[key]
    seq = list(old)
    seq[index] = new
    params[key] = type(old)(*seq) if hasattr(old, "_fields") else tuple(seq)


_SUB_LABELS = {"branches": "branch", "cond_jaxpr": "cond", "body_jaxpr": "body"}


def sub_label(key: str) -> str:
    """A short label for the nested-jaxpr param ``key`` (``branch`` for cond's ``branches``)."""
    return _SUB_LABELS.get(key, key)


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(constants, carries)`` among a scan's operands."""
    if "ft_in" in params:  # jax >= 0.11: operands are a flat tree (consts, carry, xs)
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    return params["num_consts"], params["num_carry"]


SCAN_BODY = "jaxpr"
"""The param of ``scan`` that holds its body (the label of the body in equation paths)."""


WHILE_COND, WHILE_BODY = "cond_jaxpr", "body_jaxpr"
"""The params of ``while`` that hold its condition and body (their labels in equation paths)."""


def while_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(condition constants, body constants)`` among a while's operands (the carries follow)."""
    return params["cond_nconsts"], params["body_nconsts"]


def cond_branches(params: dict[str, Any]) -> list[str]:
    """The path labels of a cond's branches (``branches[0]`` ...), for :meth:`Visit.eval_body`."""
    return [f"branches[{i}]" for i in range(len(params["branches"]))]


def scan_loop(params: dict[str, Any]) -> dict[str, Any]:
    """``lax.scan``'s loop arguments of a scan equation: ``length``, ``reverse``, ``unroll``."""
    return {k: params[k] for k in ("length", "reverse", "unroll")}


def nested_links(
    eqn: JaxprEqn, key: str, inner: Jaxpr
) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
    """How the nested jaxpr ``inner`` at param ``key`` of ``eqn`` meets the equation.

    Returns ``(inputs, outputs)``: pairs ``(inner input, outer operand)`` and ``(inner output,
    outer result)`` that hold the same value each iteration (a scan's sliced ``xs`` and stacked
    ``ys`` are left out; so are a while's condition output and the cond's branch index).
    """
    prim, p = eqn.primitive.name, eqn.params
    ins: list[Any] = list(eqn.invars)
    outs: list[Any] = list(eqn.outvars)
    if prim == "cond":
        ins = ins[1:]
    elif prim == "while":
        cond_n, body_n = p["cond_nconsts"], p["body_nconsts"]
        carry = ins[cond_n + body_n :]
        ins = [*ins[:cond_n], *carry] if key == "cond_jaxpr" else ins[cond_n:]
        if key == "cond_jaxpr":
            outs = []
    elif prim == "scan":
        n_consts, n_carry = scan_counts(p)
        ins, outs = ins[: n_consts + n_carry], outs[:n_carry]
    return (
        list(zip(inner.invars, ins, strict=False)),
        list(zip(inner.outvars, outs, strict=False)),
    )


_INLINE_BODY = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "checkpoint": "jaxpr",  # (remat: outside differentiation it computes its body)
    "remat2": "jaxpr",
}
INLINE_CALLS: frozenset[str] = frozenset(_INLINE_BODY)
"""The call primitives :func:`inline_body` opens (an interpreter runs their bodies in place)."""
CUSTOM_CALLS = ("custom_jvp_call", "custom_vjp_call")
"""The custom-derivative call primitives."""


def inline_body(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """The body of a call-like equation (jit, custom_jvp_call, custom_vjp_call, checkpoint) that evaluates
    exactly like the equation on the same operands; None for any other equation."""
    key = _INLINE_BODY.get(eqn.primitive.name)
    return None if key is None else as_closed(eqn.params[key])


def is_open_param(eqn: JaxprEqn, sub: Jaxpr | ClosedJaxpr) -> bool:
    """Whether ``sub``, a jaxpr param of ``eqn``, is re-bound without constants of its own (an
    open Jaxpr on JAX 0.10; on 0.11+, where every Jaxpr is closed, any param but a ``jit`` body,
    whose constants JAX itself keeps with it)."""
    if ClosedJaxpr is not Jaxpr:
        return not isinstance(sub, ClosedJaxpr)
    return not is_call_eqn(eqn)


def as_closed(j: Jaxpr | ClosedJaxpr) -> ClosedJaxpr:
    return j if isinstance(j, ClosedJaxpr) else ClosedJaxpr(j, [])


def new_var(aval: Any) -> Var:
    return Var(aval)


# -- partition: outlined calls and explicit copies -------------------------------------------------
_TEMPLATES: dict[str, JaxprEqn] = {}


def _template(kind: str) -> JaxprEqn:
    """A traced example equation of ``kind`` ("jit" or "device_put") whose params we copy."""
    if kind not in _TEMPLATES:
        import jax.numpy as jnp

        if kind == "jit":
            closed = jax.make_jaxpr(lambda x: jax.jit(lambda y: y + 1.0)(x))(jnp.float32(0))
        else:
            dev = jax.devices()[0]
            closed = jax.make_jaxpr(lambda x: jax.device_put(x, dev))(jnp.float32(0))
        _TEMPLATES[kind] = closed.jaxpr.eqns[0]
    return _TEMPLATES[kind]


def make_call_eqn(
    closed: ClosedJaxpr, invars: list[Any], outvars: list[Any], name: str, like: JaxprEqn | None
) -> JaxprEqn:
    """A nested ``jit`` equation named ``name`` that calls ``closed`` (shows up as a named function in
    StableHLO). Source info and context come from ``like`` when given."""
    t = _template("jit")
    n_in, n_out = len(invars), len(outvars)
    unspec = t.params["in_shardings"][0]
    params = dict(
        t.params,
        jaxpr=closed,
        in_shardings=(unspec,) * n_in,
        out_shardings=(unspec,) * n_out,
        in_layouts=(None,) * n_in,
        out_layouts=(None,) * n_out,
        donated_invars=(False,) * n_in,
        name=name,
    )
    src = like if like is not None else t
    return new_jaxpr_eqn(
        invars, outvars, t.primitive, params, closed.effects, src.source_info, src.ctx
    )


def is_call_eqn(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is a nested ``jit`` call (what :func:`make_call_eqn` makes)."""
    return eqn.primitive is _template("jit").primitive


def call_name(eqn: JaxprEqn) -> str | None:
    """The function name of a nested ``jit`` call; None for any other equation."""
    return eqn.params.get("name") if is_call_eqn(eqn) else None


def call_body(eqn: JaxprEqn) -> ClosedJaxpr:
    """The body of a nested ``jit`` call (see :func:`is_call_eqn`)."""
    if not is_call_eqn(eqn):
        raise TypeError(f"call_body: {eqn.primitive.name} is not a jit call")
    return as_closed(eqn.params["jaxpr"])


def make_device_put_eqn(x: Any, out: Var, device: Any, like: JaxprEqn | None) -> JaxprEqn:
    """An explicit copy of ``x`` to ``device`` (a ``jax.Device``) as a ``device_put`` equation."""
    t = _template("device_put")
    params = dict(t.params, devices=(device,), srcs=(None,))
    src = like if like is not None else t
    return new_jaxpr_eqn([x], [out], t.primitive, params, t.effects, src.source_info, src.ctx)


def make_jaxpr(
    constvars: list[Var],
    invars: list[Var],
    outvars: list[Any],
    eqns: list[JaxprEqn],
    name: str = "region",
) -> Jaxpr:
    """A Jaxpr (debug info naming it ``name``) whose effects are its equations' effects."""
    from jax._src import core as _core

    effects: set[Any] = set()
    for e in eqns:
        effects.update(e.effects)
    info = _core.DebugInfo(
        "jit",
        name,
        tuple(f"args[{i}]" for i in range(len(invars))),
        tuple(f"result[{i}]" for i in range(len(outvars))),
    )
    return Jaxpr(constvars, invars, outvars, eqns, frozenset(effects), info)


@functools.cache
def primitive_names() -> frozenset[str]:
    """The names of JAX's own primitives (``jax.extend.core.primitives``), and of the calls
    other JAX versions name otherwise (``pjit``, ``remat2``, ``copy_p``)."""
    from jax.extend.core import primitives

    own = {p.name for p in vars(primitives).values() if isinstance(p, jcore.Primitive)}
    return frozenset(own | INLINE_CALLS | {"closed_call", "core_call", "copy_p"})


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a tracer (we are inside jit, vmap, grad...): its value is not known."""
    return isinstance(x, jax.core.Tracer)


@contextlib.contextmanager
def no_source_locations() -> Iterator[None]:
    """Lower programs without the directories of source files in their locations; with
    :func:`without_traceback` on every equation, an exported program is the same whoever traced
    it and reveals no local paths."""
    from jax._src import config as jax_config

    with (
        jax_config.include_full_tracebacks_in_locations(False),
        jax_config.hlo_source_file_canonicalization_regex(".*/"),  # (jaxq's own frames: no dirs)
    ):
        yield


def without_traceback(eqn: JaxprEqn) -> JaxprEqn:
    """The equation without the Python traceback of the code that traced it (names kept)."""
    info = eqn.source_info
    return eqn.replace(source_info=type(info)(None, info.name_stack))
