"""The IR: an immutable traced program (a ClosedJaxpr plus its calling convention and metadata)."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxq import _compat as C
from jaxq import _names, _nnx
from jaxq._layouts import layout_map

_EMPTY: Mapping[str, Any] = types.MappingProxyType({})


class TraceError(Exception):
    """``jaxq.trace`` could not turn a function into a jaxpr."""


class EquationView:
    """What every view of one equation offers (the records of ``equations()``, a rule's visit)."""

    __slots__ = ()
    eqn: C.JaxprEqn

    @property
    def primitive(self) -> str:
        """The primitive's name (``"dot_general"``)."""
        return self.eqn.primitive.name

    @property
    def params(self) -> dict[str, Any]:
        """The equation's params (``dimension_numbers``, ``axes``...)."""
        return self.eqn.params

    @property
    def in_avals(self) -> tuple[Any, ...]:
        """The avals (shape and dtype) of the operands."""
        return tuple(v.aval for v in self.eqn.invars)

    @property
    def out_avals(self) -> tuple[Any, ...]:
        """The avals (shape and dtype) of the results."""
        return tuple(v.aval for v in self.eqn.outvars)


@dataclasses.dataclass(frozen=True, eq=False)
class Equation(EquationView):
    """One equation of a Program, as yielded by :meth:`Program.equations`.

    Attributes:
      name: the equation's stable name (``Dense_0/dot_general``).
      eqn: the jaxpr equation itself.
      path: where it sits: equation indices interleaved with the labels of the nested jaxprs on
        the way down (``(2, label, 0)``: the first equation inside the third one's body).
      in_layouts: the layout of each operand (``"NC"``, ``"IO"``...), None where unknown.
      out_layouts: the layout of each result, None where unknown.
    """

    name: str
    eqn: C.JaxprEqn
    path: tuple[Any, ...]
    in_layouts: tuple[str | None, ...]
    out_layouts: tuple[str | None, ...]

    def __repr__(self) -> str:
        return f"Equation({self.name!r}, {self.primitive})"


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """An immutable traced program.

    Attributes:
      jaxpr: the ClosedJaxpr (the IR itself).
      in_tree, out_tree: pytree structure of ``(args, kwargs)`` and of the result.
      in_paths: readable names of the flat inputs (``args[0]['w']``), for error messages.
      name: the traced function's name; partitioning names regions after it.
      layouts: layout string per value (``NHWC``, ``HWIO``...) once ``infer_layouts`` has run, else None.
      meta: free-form results that passes attach (calibrated scales, regions...).
    """

    jaxpr: C.ClosedJaxpr
    in_tree: Any
    out_tree: Any
    in_paths: tuple[str, ...]
    name: str = "program"
    layouts: Mapping[C.Var, str] | None = None
    meta: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)

    def __copy__(self) -> Program:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Program:
        """Itself: a Program is immutable (and its jaxpr's tracebacks cannot be copied)."""
        return self

    # -- evaluation -------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.as_fun()(*args, **kwargs)

    def as_fun(self) -> Callable[..., Any]:
        """An ordinary JAX function with the original signature (jit, vmap, grad, export accept it)."""
        closed = self.jaxpr
        run = C.jaxpr_as_fun(closed)

        def fun(*args: Any, **kwargs: Any) -> Any:
            flat = self.flatten_args(args, kwargs)
            # (arrays, as under jit: an output that is an input or a literal came back as is)
            outs = [y if isinstance(y, jax.Array) else jnp.asarray(y) for y in run(*flat)]
            return jax.tree.unflatten(self.out_tree, outs)

        fun.__name__ = fun.__qualname__ = self.name
        return fun

    def flatten_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Flatten a call's arguments, given as the tuple of positional arguments and the dict
        of keyword ones (``program.flatten_args((w, x), {})``), and check them against the
        traced signature."""
        flat, tree = jax.tree.flatten((args, kwargs))
        if tree != self.in_tree:
            raise TypeError(
                "Program called with arguments of a different structure than it was traced with.\n"
                f"  traced: {self.in_tree}\n  got:    {tree}\n"
                "Call it with the same positional/keyword structure, or trace it again."
            )
        bad = []
        out = []
        for path, x, aval in zip(self.in_paths, flat, self.jaxpr.in_avals, strict=True):
            shape, dtype = jnp.shape(x), _dtype_of(x)
            if isinstance(x, (int, float, bool, complex)) and shape == aval.shape:
                if not _scalar_fits(x, aval.dtype):
                    bad.append(f"  {path}: expected {aval.str_short()}, got Python {x!r}")
                    continue
                x, dtype = jnp.asarray(x, aval.dtype), aval.dtype
            elif dtype != aval.dtype and _canonical(dtype) == aval.dtype and shape == aval.shape:
                x, dtype = jnp.asarray(x, aval.dtype), aval.dtype  # float64 -> float32, as jit
            if shape != aval.shape or dtype != aval.dtype:
                bad.append(f"  {path}: expected {aval.str_short()}, got {short_type(dtype, shape)}")
            out.append(x)
        if bad:
            raise TypeError(
                "Program called with arguments that do not match the traced shapes/dtypes:\n"
                + "\n".join(bad)
                + "\nA Program is specialised to its example arguments; trace it again for new "
                "shapes (jaxq.trace(f, *new_args))."
            )
        return out

    # -- inspection -------------------------------------------------------------------------------
    @functools.cached_property
    def names(self) -> dict[tuple[Any, ...], str]:
        """Stable name of every equation, keyed by its path (see :meth:`equations`)."""
        return {path: name for path, name, _, _ in self.walk_names()}

    def equations(self) -> Iterator[Equation]:
        """Every equation in program order, nested ones (jit, scan, cond, ...) right after their
        parent."""
        for path, _, _, eqn in self.walk_names():
            yield self.equation_at(path, eqn)

    def walk_names(self) -> Iterator[tuple[tuple[Any, ...], str, str, C.JaxprEqn]]:
        """``(path, name, local name, eqn)`` of every equation (see ``_names.walk_names``),
        the calls that only group equations (regions, device segments) named as such."""
        return _names.walk_names(self.jaxpr.jaxpr, groups=self.meta.get(_names.GROUPS, ()))

    def equation_at(self, path: tuple[Any, ...], eqn: C.JaxprEqn) -> Equation:
        """``eqn``, found at ``path`` (see :meth:`equations`), with its name and layouts."""
        lay: Mapping[Any, str] = self.layouts or {}
        return Equation(
            self.names.get(path, eqn.primitive.name),
            eqn,
            path,
            tuple(None if C.is_literal(v) else lay.get(v) for v in eqn.invars),
            tuple(lay.get(v) for v in eqn.outvars),
        )

    def equation(self, name: str) -> Equation:
        """The equation named ``name`` (:class:`KeyError` if there is none)."""
        for e in self.equations():
            if e.name == name:
                return e
        raise KeyError(f"no equation named {name!r}; see [e.name for e in program.equations()]")

    def __len__(self) -> int:
        """Number of equations, nested ones included."""
        return sum(1 for _ in self.walk_names())

    def replace(self, **changes: Any) -> Program:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def with_jaxpr(self, jaxpr: C.ClosedJaxpr, **changes: Any) -> Program:
        """A new Program around a rewritten jaxpr. Value metadata keyed by variables (layouts) refers
        to the old jaxpr, so it is recomputed when the old program had it."""
        new = dataclasses.replace(self, jaxpr=jaxpr, layouts=None, **changes)
        n_in, n_out = len(jaxpr.in_avals), len(jaxpr.out_avals)
        if not new.in_tree.num_leaves == len(new.in_paths) == n_in or (
            new.out_tree.num_leaves != n_out
        ):
            raise ValueError(
                f"with_jaxpr: the new jaxpr of {self.name!r} takes {n_in} input(s) and returns "
                f"{n_out}, where the program's signature has {new.in_tree.num_leaves} and "
                f"{new.out_tree.num_leaves}: a pass keeps the calling convention, or passes "
                "the new in_tree, in_paths and out_tree along (with_jaxpr(j, in_tree=...))"
            )
        if self.layouts is not None and "layouts" not in changes:
            new = dataclasses.replace(new, layouts=layout_map(jaxpr))
        return new

    def save(self, path: Any, names: Mapping[int, str] | None = None) -> Any:
        """Write the program and its constants to one safetensors file (see ``jaxq.load``);
        ``names`` gives some constants (by index) readable tensor names."""
        from jaxq._serialize import save  # the serializer builds on Program: import at use

        return save(self, path, names)

    def __str__(self) -> str:
        from jaxq._printer import format_program  # the printer reads Programs: import at use

        return format_program(self)

    def __repr__(self) -> str:
        n = len(self.jaxpr.in_avals)
        return f"<jaxq.Program: {len(self)} equations, {n} inputs, {len(self.jaxpr.out_avals)} outputs>"


def _canonical(dtype: Any) -> Any:
    """The dtype JAX computes in for ``dtype`` (float64 is float32 unless x64 is on)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # (typed PRNG keys: as they are)
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype)


def _scalar_fits(x: bool | int | float | complex, dtype: Any) -> bool:
    """Whether a Python scalar converts to ``dtype`` as JAX would promote it (bool only to bool;
    int to an integer type it fits in, or to inexact; float to inexact; complex to complex) and
    without overflowing to Inf."""
    if isinstance(x, bool):
        return jnp.issubdtype(dtype, jnp.bool_)
    if jnp.issubdtype(dtype, jnp.bool_):
        return False
    if isinstance(x, int) and jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return int(info.min) <= x <= int(info.max)
    if isinstance(x, complex) and not jnp.issubdtype(dtype, jnp.complexfloating):
        return False
    if not jnp.issubdtype(dtype, jnp.inexact):
        return False
    with np.errstate(over="ignore"):
        return bool(np.all(np.isfinite(np.asarray(x, dtype)))) or not np.isfinite(x)


def short_type(dtype: Any, shape: Any) -> str:
    """``float32[7,4]``: a dtype and shape as JAX writes an aval, for messages comparing them
    (``[7,4]`` for a dtype of None)."""
    if dtype is None:
        name = ""
    else:  # (an extended dtype, a typed PRNG key's, is no numpy dtype: its own name)
        name = np.dtype(dtype).name if isinstance(dtype, (np.dtype, type)) else str(dtype)
    return f"{name}[{','.join(map(str, shape))}]"


def _dtype_of(x: Any) -> Any:
    if hasattr(x, "dtype"):
        return x.dtype
    return jnp.result_type(x)


def leaf_dtype(x: Any) -> Any:
    """The dtype ``x`` has as an argument of a JAX call (float64 is float32 unless x64 is on,
    as under ``jit``; typed PRNG keys as they are)."""
    return _canonical(_dtype_of(x))


def trace(f: Callable[..., Any], *example_args: Any, **example_kwargs: Any) -> Program:
    """Trace ``f`` at the example arguments (arrays or ``jax.ShapeDtypeStruct``) into a Program."""
    if not callable(f):
        raise TypeError(f"jaxq.trace: expected a callable; got {type(f).__name__}")
    leaves_with_paths, in_tree = jax.tree_util.tree_flatten_with_path(
        (example_args, example_kwargs)
    )
    in_paths = tuple(_path_str(p) for p, _ in leaves_with_paths)
    flat = [leaf for _, leaf in leaves_with_paths]
    for path, leaf in zip(in_paths, flat, strict=True):
        if not (isinstance(leaf, jax.ShapeDtypeStruct) or _is_arraylike(leaf)):
            raise TypeError(
                f"jaxq.trace: argument {path} is a {type(leaf).__name__}, not an array.\n"
                "Only arrays (or jax.ShapeDtypeStruct) can be traced. Close over static values "
                "instead: jaxq.trace(functools.partial(f, option=value), *arrays)."
            )
    out_tree_box: list[Any] = []

    def flat_fun(*flat_args: Any) -> list[Any]:
        args, kwargs = jax.tree.unflatten(in_tree, flat_args)
        out_flat, out_tree = jax.tree.flatten(f(*args, **kwargs))
        out_tree_box.append(out_tree)
        return out_flat

    name = getattr(f, "__name__", type(f).__name__)
    # an NNX model names its layers by module path, as linen models do by themselves
    # (and so does one a function builds from its params with nnx.merge: the split form)
    scopes = _nnx.module_scopes(f) if _nnx.is_nnx_module(f) else _nnx.merged_scopes()
    try:
        with scopes:
            closed = jax.make_jaxpr(flat_fun)(*flat)
        if hasattr(f, "lower"):  # (a jax.jit-decorated function: the program is its body)
            closed = _jit_body(closed)
        closed = _own_constants(closed)
    except jax.errors.JAXTypeError as e:
        raise TraceError(
            f"jaxq.trace could not trace {name}: {type(e).__name__}: {e}\n"
            "jaxq traces the function once with abstract values, so Python control flow on array "
            "values cannot be traced. Use jax.lax.cond / jnp.where / jax.lax.while_loop for "
            "value-dependent control flow, or close over the value if it is static."
        ) from e
    except Exception as e:
        hint = (
            "\njaxq traces every argument, so a jitted function's static argument arrives as a "
            "traced value. Bind it instead: jaxq.trace(jax.jit(functools.partial(f, n=3)), x)."
            if "Non-hashable static arguments" in str(e)
            else ""
        )
        raise TraceError(f"jaxq.trace could not trace {name}: {type(e).__name__}: {e}{hint}") from e
    return Program(closed, in_tree, out_tree_box[-1], in_paths, name=_identifier(name))


def _own_constants(closed: C.ClosedJaxpr) -> C.ClosedJaxpr:
    """The program with its own read-only copy of each writable numpy array the function closed
    over: tracing keeps them by reference, so changing the user's array afterwards would change
    an immutable program's results (``jax.jit`` copies them to the device when it compiles)."""
    if not any(isinstance(c, np.ndarray) and c.flags.writeable for c in closed.consts):
        return closed
    consts = []
    for c in closed.consts:
        if isinstance(c, np.ndarray) and c.flags.writeable:
            c = c.copy()  # (its own class: jax 0.12 keeps numpy constants as a subclass)
            c.flags.writeable = False
        consts.append(c)
    return C.ClosedJaxpr(closed.jaxpr, consts)


def _jit_body(closed: C.ClosedJaxpr) -> C.ClosedJaxpr:
    """The body of a program that is one ``jit`` call of all its inputs, in order, returning all
    its outputs (what tracing a ``jax.jit``-decorated function gives): so passes see its
    equations at the top level, where annotations are partitioned and placed, and names do not
    begin with ``jit/``. Any other program as it is (static arguments, constants)."""
    jaxpr = closed.jaxpr
    if len(jaxpr.eqns) != 1 or jaxpr.constvars:
        return closed
    (eqn,) = jaxpr.eqns
    body = C.inline_body(eqn) if eqn.primitive.name in ("jit", "pjit") else None
    same = list(eqn.invars) == list(jaxpr.invars) and list(eqn.outvars) == list(jaxpr.outvars)
    return body if body is not None and same else closed


def _identifier(name: str) -> str:
    clean = "".join(c if c.isalnum() or c == "_" else "_" for c in name).strip("_")
    return clean or "program"


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool, complex)) or hasattr(
        x, "__jax_array__"
    )


def _path_str(path: tuple[Any, ...]) -> str:
    # path[0] selects args (0) or kwargs (1)
    head, rest = path[0], path[1:]
    root = "args" if getattr(head, "idx", None) == 0 else "kwargs"
    if root == "args" and rest:
        first, rest = rest[0], rest[1:]
        root = f"args[{first.idx}]"
    elif root == "kwargs" and rest:
        first, rest = rest[0], rest[1:]
        root = str(first.key)
    return root + jax.tree_util.keystr(tuple(rest))
