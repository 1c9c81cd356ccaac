"""Which compiler supports which equations: a table ``compiler -> primitive -> predicate``.

The rule for equations that hold nested jaxprs (documented in :func:`is_supported`):

* a pure call (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``/``remat``) is
  supported by a compiler when the compiler supports *every* equation inside it, recursively (and,
  if the compiler registered the call primitive itself, its predicate holds too);
* a composite made by ``merge_composite`` (a ``jit`` named ``"<compiler>.<pattern>"``) is supported
  by exactly that compiler, whatever it holds;
* control flow (``scan``, ``cond``, ``while``) is supported only when the compiler registered the
  primitive (and its predicate holds) *and* it supports every equation inside.

Partitioning never splits a nested call: it is one unit, in a region or outside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxq import _compat as C
from jaxq._program import Equation
from jaxq._walk import misspelled
from jaxq.annotate import is_annotation

Predicate = Callable[[Equation], bool]

_TABLE: dict[str, dict[str, Predicate | None]] = {}

CALL_PRIMITIVES = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "remat2",
        "checkpoint",
    }
)


class UnknownCompilerError(ValueError):
    """A compiler name that nothing was registered for."""


def register_op_support(compiler: str, primitive: Any, predicate: Predicate | None = None) -> Any:
    """Declare that ``compiler`` supports equations of ``primitive`` (a name such as
    ``"dot_general"`` or a Primitive) for which ``predicate(record)`` is true (always, if None).

    ``record`` is a :class:`jaxq.Equation`: ``.primitive``, ``.params``, ``.in_avals``,
    ``.out_avals`` give the dtype, shape and params; ``.name`` the stable name
    (``Dense_1/dot_general``) and ``.in_layouts`` the layouts, as ``Program.equations()`` shows
    them. Usable as a decorator on the predicate::

        @register_op_support("dnnl", "dot_general")
        def _(rec):
            return rec.in_avals[0].dtype == jnp.float32

    Registering the same ``(compiler, primitive)`` again replaces the predicate.

    Nested jaxprs: a pure call (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``)
    needs no registration and is supported when every equation inside it is; control flow
    (``scan``, ``cond``, ``while``) must be registered *and* have every equation inside supported;
    a composite ``jit`` named ``"<compiler>.<name>"`` belongs to that compiler. A nested call is
    never split: it is in a region as a whole or not at all.
    """
    if not isinstance(compiler, str) or not compiler:
        raise TypeError(
            f"register_op_support: compiler must be a non-empty string; got {compiler!r}"
        )
    if "." in compiler:
        raise ValueError(
            f"register_op_support: compiler must not contain '.'; got {compiler!r} ('.' separates a "
            "compiler from a composite name, as in 'dnnl.conv_bias_relu')"
        )
    name = getattr(primitive, "name", primitive)
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"register_op_support: primitive must be a name or a Primitive; got {primitive!r}"
        )
    if predicate is not None and not callable(predicate):
        raise TypeError(f"register_op_support: predicate must be callable; got {predicate!r}")
    if is_annotation(name):
        raise ValueError(
            f"register_op_support: {name!r} is a jaxq annotation, which regions never hold "
            "(annotate_target leaves annotations between regions); quantized code reaches a "
            "compiler as the core ops jaxq.quantize realizes"
        )
    misspelled(primitive, "register_op_support")
    _TABLE.setdefault(compiler, {})[name] = predicate
    if predicate is None:
        # Used as a decorator: @register_op_support(c, p) def pred(rec): ...
        def decorate(fn: Predicate) -> Predicate:
            if not callable(fn):
                raise TypeError(f"register_op_support: expected a predicate; got {fn!r}")
            _TABLE[compiler][name] = fn
            return fn

        return decorate
    return predicate


def unregister_compiler(compiler: str) -> None:
    """Forget everything registered for ``compiler`` (no error if nothing was)."""
    _TABLE.pop(compiler, None)


def registered_compilers() -> tuple[str, ...]:
    """The compilers that have op support registered, in registration order."""
    return tuple(_TABLE)


def check_compilers(compilers: Any, where: str) -> tuple[str, ...]:
    if isinstance(compilers, str):
        compilers = [compilers]
    out = tuple(compilers)
    for c in out:
        if c not in _TABLE:
            known = ", ".join(sorted(_TABLE)) or "none registered"
            raise UnknownCompilerError(
                f"{where}: unknown compiler {c!r} (known: {known}). Register what it supports "
                f"first: jaxq.partition.register_op_support({c!r}, 'dot_general')"
            )
    return out


def _record(path: tuple[Any, ...], eqn: C.JaxprEqn) -> Equation:
    return Equation(
        eqn.primitive.name, eqn, path, (None,) * len(eqn.invars), (None,) * len(eqn.outvars)
    )


def composite_compiler(eqn: C.JaxprEqn) -> str | None:
    """The compiler a composite call is meant for (``"dnnl"`` for a jit named
    ``"dnnl.conv_relu"``), else None."""
    name = C.call_name(eqn)
    if name is None:
        return None
    head, dot, _ = name.partition(".")
    return head if dot and head else None


def is_supported(
    compiler: str,
    eqn: C.JaxprEqn,
    record: Callable[[tuple[Any, ...], C.JaxprEqn], Equation] = _record,
    path: tuple[Any, ...] = (),
) -> bool:
    """Whether ``compiler`` supports ``eqn`` under the rule in this module's docstring.
    ``record(path, eqn)`` is what a predicate gets (``Program.equation_at``: its stable name and
    layouts)."""
    table = _TABLE.get(compiler, {})
    prim = eqn.primitive
    if is_annotation(prim):
        return False
    comp = composite_compiler(eqn)
    if comp is not None:
        return comp == compiler
    subs = C.subjaxpr_params(eqn.params)
    if prim.name in table:
        pred = table[prim.name]
        try:
            ok = pred is None or bool(pred(record(path, eqn)))
        except Exception as e:
            raise RuntimeError(
                f"op-support predicate of compiler {compiler!r} for {prim.name!r} raised "
                f"{type(e).__name__}: {e}"
            ) from e
        if not ok:
            return False
    elif not subs or prim.name not in CALL_PRIMITIVES:
        return False
    for key, idx, sub in subs:
        inner = sub.jaxpr if isinstance(sub, C.ClosedJaxpr) else sub
        label = key if idx is None else f"{key}[{idx}]"
        if not all(
            is_supported(compiler, e, record, (*path, label, j)) for j, e in enumerate(inner.eqns)
        ):
            return False
    return True
