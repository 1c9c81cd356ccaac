"""Flax NNX module paths as name scopes, so NNX layers get stable names as linen layers do.

Flax linen pushes each module's name onto JAX's name stack, which is where jaxq's names come from
(``CNN/Dense_0/dot_general``). NNX modules push nothing, so every matmul of an NNX model would be
``dot_general``, ``dot_general_1``, ... While :func:`module_scopes` is active, calling a module of
the given graph runs under a named scope: its attribute path from the calling module, its class name
at the root (``MLP/dense1/dot_general``, ``MLP/blocks/0/dot_general``). Flax is imported only when
asked for; jaxq does not depend on it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax

Path = tuple[Any, ...]


class _Active:
    """The paths of one module graph (by object id) and the modules being called, innermost last."""

    def __init__(self, paths: dict[int, Path], types: dict[type, list[tuple[Path, Any]]]) -> None:
        self.paths = paths
        self.types = types  # the modules of each class in the graph, with their paths
        self.calls: list[Path] = []
        self.adopted: list[Any] = []  # (kept alive: their ids stay theirs)

    def path(self, module: Any) -> Path | None:
        """``module``'s path; for a module not in the graph, the path of the one module of its
        class that is (of those, the one whose params have the same shapes): NNX transforms
        (``nnx.scan`` over a stack of layers, ``nnx.vmap``, ``nnx.remat``) call a copy of the
        module they were given, which then takes its path, its submodules theirs below it."""
        path = self.paths.get(id(module))
        same = self.types.get(type(module), [])
        if path is not None or not same:
            return path
        if len(same) > 1:
            same = [(p, m) for p, m in same if _shapes(m) == _shapes(module)]
            if len(same) != 1:
                return None
        from flax import nnx

        for sub, m in nnx.iter_modules(module):
            self.paths.setdefault(id(m), same[0][0] + tuple(sub))
        self.adopted.append(module)
        return same[0][0]


def _shapes(module: Any) -> Any:
    from flax import nnx

    state = nnx.state(module, nnx.Param)
    return jax.tree.structure(state), [jax.numpy.shape(v) for v in jax.tree.leaves(state)]


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
    "jaxq_nnx_scopes", default=None
)


def is_nnx_module(obj: Any) -> bool:
    """Whether ``obj`` is a Flax NNX module (without importing flax when it is not loaded)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(obj, nnx.Module)


def _scoped(call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        active = _ACTIVE.get()
        path = None if active is None else active.path(self)
        # a module outside the graph, or a subclass's __call__ calling its base's: no new scope
        if active is None or path is None or (active.calls and active.calls[-1] == path):
            return call(self, *args, **kwargs)
        outer = active.calls[-1] if active.calls else None
        rel = path[len(outer) :] if outer is not None and path[: len(outer)] == outer else path
        active.calls.append(path)
        try:
            with jax.named_scope("/".join(map(str, rel)) or type(self).__name__):
                return call(self, *args, **kwargs)
        finally:
            active.calls.pop()

    wrapper._jaxq_scoped = True  # type: ignore[attr-defined]
    return wrapper


@contextlib.contextmanager
def module_scopes(module: Any) -> Iterator[None]:
    """While active, each module of ``module``'s graph called through ``__call__`` runs under a
    JAX named scope of its path, so traced equations get names such as ``MLP/dense1/dot_general``.

    ``jaxq.trace(model, x)`` does this by itself for an NNX module, and for a module a traced
    function builds with ``nnx.merge`` (``jaxq.quantize(lambda state, x: nnx.merge(graphdef,
    state)(x), state, ...)``, params as an argument); use this around ``jaxq.trace`` or
    ``jaxq.quantize`` when the function only closes over the model::

        with jaxq.module_scopes(model):
            program = jaxq.trace(lambda x: model(x), x)

    Only ``__call__`` is scoped; a module reached through another method is named under its caller.
    """
    try:
        from flax import nnx
    except ImportError as e:
        raise ImportError("jaxq.module_scopes needs Flax NNX: pip install flax") from e
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"jaxq.module_scopes: expected a flax.nnx.Module; got {type(module).__name__}"
        )
    paths: dict[int, Path] = {}
    classes: dict[type, list[tuple[Path, Any]]] = {}  # in graph order (a deterministic patch
    for path, m in nnx.iter_modules(module):  # and restore order)
        if id(m) not in paths:
            paths[id(m)] = tuple(path)
            classes.setdefault(type(m), []).append((tuple(path), m))
    patched: list[tuple[type, bool, Callable[..., Any]]] = []
    for cls in classes:
        call = next((k.__dict__["__call__"] for k in cls.__mro__ if "__call__" in k.__dict__), None)
        if call is None or getattr(call, "_jaxq_scoped", False):
            continue
        patched.append((cls, "__call__" in cls.__dict__, call))
        # setattr: mypy rejects assigning to a method
        setattr(cls, "__call__", _scoped(call))  # noqa: B010
    token = _ACTIVE.set(_Active(paths, classes))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        for cls, own, call in reversed(patched):
            if own:
                setattr(cls, "__call__", call)  # noqa: B010
            else:
                delattr(cls, "__call__")


@contextlib.contextmanager
def merged_scopes() -> Iterator[None]:
    """While active, a module that ``flax.nnx.merge`` builds gets the scopes :func:`module_scopes`
    gives (for the rest of the context): the split form of a model with params as an argument,
    ``f = lambda state, x: nnx.merge(graphdef, state)(x)``, is named like the model itself. A
    no-op when Flax NNX is not loaded."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or not hasattr(nnx, "merge"):
        yield
        return
    merge = getattr(nnx, "merge")  # noqa: B009 (flax is not a dependency: untyped here)
    scopes = contextlib.ExitStack()

    @functools.wraps(merge)
    def scoped_merge(*args: Any, **kwargs: Any) -> Any:
        module = merge(*args, **kwargs)
        if isinstance(module, nnx.Module) and _ACTIVE.get() is None:
            scopes.enter_context(module_scopes(module))
        return module

    setattr(nnx, "merge", scoped_merge)  # noqa: B010
    try:
        with scopes:
            yield
    finally:
        setattr(nnx, "merge", merge)  # noqa: B010
