"""Backends: ``codegen(region_program) -> callable`` registered by compiler name.

Built in: ``"xla"`` (XLA, optionally on a chosen device: :func:`xla_backend`) and ``"host"`` (a
reference external runtime: the region is interpreted with numpy on the host, called through
``jax.pure_callback`` so it still works under ``jit``). ``"onnxruntime"`` registers itself when the
optional ``onnx`` and ``onnxruntime`` packages are installed (see ``_onnx.py``).

A callable returned by a codegen takes the region's flat inputs and returns a sequence of its flat
outputs. It may carry ``jittable = False`` when it must run eagerly (it moves data between devices,
for instance); :func:`jaxq.build` then runs the program eagerly too.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxq import _compat as C
from jaxq._program import Program

if TYPE_CHECKING:
    from jax.core import ShapedArray

Codegen = Callable[[Program], Callable[..., Sequence[Any]]]

_BACKENDS: dict[str, Codegen] = {}


class UnknownBackendError(KeyError):
    """No backend registered under a name."""

    def __str__(self) -> str:
        return str(self.args[0])


class BackendError(RuntimeError):
    """A backend failed to compile or run a region; the message names the region."""


def shaped_aval(atom: Any) -> ShapedArray:
    """``atom.aval`` as a ShapedArray: regions compute on arrays only, but JAX types ``Var.aval`` as
    the base ``AbstractValue``, which has no shape or dtype."""
    return cast("ShapedArray", atom.aval)


def register_backend(compiler: str, codegen: Codegen) -> None:
    """Run regions of ``compiler`` with ``codegen(region_program)``, which returns a callable taking
    the region's flat inputs and returning a sequence of its flat outputs. ``jaxq.build`` compiles
    the whole program with ``jax.jit``, so the callable sees traced values: one that must run
    eagerly (numpy, a vendor library called from Python) sets ``run.jittable = False``, or calls
    its library through ``jax.pure_callback`` (as the ``"host"`` backend does)."""
    if not isinstance(compiler, str) or not compiler:
        raise TypeError(f"register_backend: compiler must be a non-empty string; got {compiler!r}")
    if not callable(codegen):
        raise TypeError(f"register_backend: codegen must be callable; got {codegen!r}")
    _BACKENDS[compiler] = codegen


def unregister_backend(compiler: str) -> None:
    """Forget the backend registered as ``compiler`` (no error if there is none)."""
    _BACKENDS.pop(compiler, None)


def registered_backends() -> tuple[str, ...]:
    """The names backends are registered under (``"xla"``, ``"host"``, ``"onnxruntime"`` and
    yours), in registration order."""
    return tuple(_BACKENDS)


def get_backend(name: str, *, region: str | None = None, compiler: str | None = None) -> Codegen:
    """The codegen registered as ``name``; ``region`` and ``compiler`` (the region's, which
    ``build``'s ``backends`` mapped to ``name``) make the error for an unknown name specific."""
    try:
        return _BACKENDS[name]
    except KeyError:
        where = f" for region {region!r}" if region else ""
        known = ", ".join(sorted(_BACKENDS))
        compiler = name if compiler is None else compiler
        close = difflib.get_close_matches(name, list(_BACKENDS), n=1)
        hint = f"Did you mean {close[0]!r}? " if close else ""
        raise UnknownBackendError(
            f"unknown backend {name!r}{where} (registered: {known}). {hint}Register one with "
            f"jaxq.partition.register_backend({name!r}, codegen), or map the compiler to a known "
            f"backend: jaxq.build(program, backends={{{compiler!r}: 'xla'}})."
        ) from None


def _device(device: Any) -> jax.Device:
    if isinstance(device, jax.Device):
        return device
    from jaxq.annotate._on_device import canonical_device

    platform, _, index = canonical_device(device, "xla_backend").partition(":")
    return jax.devices(platform)[int(index)]


def xla_backend(device: Any = None) -> Codegen:
    """A codegen that compiles regions with XLA; on ``device`` (``"cpu:1"`` or a ``jax.Device``)
    when given (that callable runs eagerly: inputs are copied to the device, results stay there)."""
    dev = None if device is None else _device(device)

    def codegen(region: Program) -> Callable[..., Sequence[Any]]:
        fn = jax.jit(C.jaxpr_as_fun(region.jaxpr))
        if dev is None:
            return fn
        sharding = jax.sharding.SingleDeviceSharding(dev)
        placed = jax.jit(C.jaxpr_as_fun(region.jaxpr), out_shardings=sharding)

        def run(*args: Any) -> Sequence[Any]:
            return placed(*(jax.device_put(a, dev) for a in args))

        run.jittable = False  # type: ignore[attr-defined]
        return run

    return codegen


# -- the host backend: a numpy interpreter ----------------------------------------------------------


def _dot_general(x: np.ndarray, y: np.ndarray, **p: Any) -> np.ndarray:
    (cx, cy), (bx, by) = p["dimension_numbers"]
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    sx = [next(letters) for _ in range(x.ndim)]
    sy = [next(letters) for _ in range(y.ndim)]
    for a, b in zip(cx, cy, strict=True):
        sy[b] = sx[a]
    for a, b in zip(bx, by, strict=True):
        sy[b] = sx[a]
    batch = [sx[a] for a in bx]
    free_x = [s for i, s in enumerate(sx) if i not in cx and i not in bx]
    free_y = [s for i, s in enumerate(sy) if i not in cy and i not in by]
    spec = f"{''.join(sx)},{''.join(sy)}->{''.join(batch + free_x + free_y)}"
    # accumulate in the result type, as XLA does (numpy sums int8 x int8 in int8, wrapping);
    # 16-bit floats in float32, rounded once at the end (numpy's einsum has no bfloat16)
    dt = np.dtype(p.get("preferred_element_type") or np.result_type(x, y))
    acc = np.dtype(np.float32) if jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4 else dt
    return np.einsum(spec, x.astype(acc), y.astype(acc)).astype(dt)


def _broadcast_in_dim(x: np.ndarray, **p: Any) -> np.ndarray:
    shape, dims = p["shape"], p["broadcast_dimensions"]
    expanded = [1] * len(shape)
    for i, d in enumerate(dims):
        expanded[d] = x.shape[i]
    return np.broadcast_to(x.reshape(expanded), shape)


def _reduce(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda x, **p: fn(x, axis=tuple(p["axes"]))


def _extreme(fn: Callable[..., Any], lowest: bool) -> Callable[..., Any]:
    """``reduce_max`` (``lowest``) or ``reduce_min``: XLA's identity (-inf, the type's
    smallest int...) over an empty axis, where numpy's max has none and raises."""

    def reduce(x: np.ndarray, **p: Any) -> np.ndarray:
        if x.dtype == np.bool_:
            start: Any = not lowest
        elif np.issubdtype(x.dtype, np.integer):
            info = np.iinfo(x.dtype)
            start = info.min if lowest else info.max
        else:
            start = -np.inf if lowest else np.inf
        return fn(x, axis=tuple(p["axes"]), initial=start)

    return reduce


def _select_n(which: np.ndarray, *cases: np.ndarray) -> np.ndarray:
    return (
        np.choose(which.astype(np.int32), cases)
        if len(cases) > 2
        else np.where(which, cases[1], cases[0])
    )


def _int_div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """XLA's integer division: truncates toward zero (Python's // floors); x / 0 = -1."""
    x, y = np.broadcast_arrays(x, y)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        safe = np.where(y == 0, 1, y).astype(y.dtype)
        q = (x - np.fmod(x, safe)) // safe  # exact: x - fmod(x, y) is a multiple of y
    return np.where(y == 0, np.asarray(-1).astype(x.dtype), q).astype(x.dtype)


def _div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.divide(x, y) if jnp.issubdtype(x.dtype, jnp.inexact) else _int_div(x, y)


def _rem(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """XLA's remainder: the sign of the dividend (C fmod); x % 0 = x for integers."""
    if jnp.issubdtype(x.dtype, jnp.floating):  # (bfloat16 too, which numpy does not count)
        with np.errstate(invalid="ignore"):  # (x % 0 is NaN, as in XLA)
            return np.fmod(x, y)
    x, y = np.broadcast_arrays(x, y)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.fmod(x, np.where(y == 0, 1, y).astype(y.dtype))
    return np.where(y == 0, x, r).astype(x.dtype)


def _shift(kind: str) -> Callable[..., np.ndarray]:
    """XLA's shifts: an amount outside [0, bits) shifts everything out (arithmetic right
    shifts fill with the sign bit)."""

    def shift(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        x, y = np.broadcast_arrays(x, y)
        bits = 8 * x.dtype.itemsize
        unsigned = np.dtype(f"uint{bits}")
        out_of_range = (y.astype(np.int64) < 0) | (y.astype(np.int64) >= bits)
        amount = np.where(out_of_range, 0, y).astype(unsigned)
        if kind == "left":
            out = (x.astype(unsigned) << amount).astype(x.dtype)
            return np.where(out_of_range, 0, out).astype(x.dtype)
        if kind == "logical":
            out = (x.astype(unsigned) >> amount).astype(x.dtype)
            return np.where(out_of_range, 0, out).astype(x.dtype)
        signed = x.astype(np.dtype(f"int{bits}"))  # (numpy's >> of an unsigned int is logical)
        out = signed >> amount.astype(signed.dtype)
        return np.where(out_of_range, signed >> (bits - 1), out).astype(x.dtype)

    return shift


def _convert(x: np.ndarray, dtype: Any) -> np.ndarray:
    """``x.astype(dtype)`` as XLA converts: a float to an integer type saturates at the type's
    range, truncates toward zero, and makes NaN 0 (numpy's cast wraps or is undefined there)."""
    dtype = np.dtype(dtype)
    if not (jnp.issubdtype(x.dtype, jnp.inexact) and np.issubdtype(dtype, np.integer)):
        return x.astype(dtype)
    info = np.iinfo(dtype)
    t = np.trunc(np.where(np.isnan(x), 0, x).astype(np.float64))
    hi, lo = t >= float(info.max), t <= float(info.min)  # (float(2**63 - 1) is 2**63)
    inside = np.where(hi | lo, 0, t).astype(dtype)
    return np.where(hi, info.max, np.where(lo, info.min, inside)).astype(dtype)


HOST_RULES: dict[str, Callable[..., Any]] = {
    "add": np.add,
    "add_any": np.add,  # (gradients add up cotangents with it)
    "sub": np.subtract,
    "mul": np.multiply,
    "div": _div,
    "rem": _rem,
    "shift_left": _shift("left"),
    "shift_right_logical": _shift("logical"),
    "shift_right_arithmetic": _shift("arithmetic"),
    "max": np.maximum,
    "min": np.minimum,
    "neg": np.negative,
    "sin": np.sin,
    "cos": np.cos,
    "tanh": np.tanh,
    "exp": np.exp,
    "log": np.log,
    "abs": np.abs,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "logistic": lambda x: 1 / (1 + np.exp(-x)),
    "sign": np.sign,
    "square": np.square,
    "integer_pow": lambda x, y: x**y,
    "pow": np.power,
    "eq": np.equal,
    "ne": np.not_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "lt": np.less,
    "le": np.less_equal,
    "select_n": _select_n,
    "dot_general": _dot_general,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": lambda x, **p: x.reshape(p["new_sizes"]),
    "transpose": lambda x, **p: np.transpose(x, p["permutation"]),
    "convert_element_type": lambda x, **p: _convert(x, p["new_dtype"]),
    "reduce_sum": _reduce(np.sum),
    "reduce_max": _extreme(np.max, lowest=True),
    "reduce_min": _extreme(np.min, lowest=False),
    "squeeze": lambda x, **p: np.squeeze(x, tuple(p["dimensions"])),
    "expand_dims": lambda x, **p: np.expand_dims(x, tuple(p["dimensions"])),
    "copy": np.copy,
    "copy_p": np.copy,
}
_PARAMS = {
    "dot_general",
    "broadcast_in_dim",
    "reshape",
    "transpose",
    "convert_element_type",
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "squeeze",
    "expand_dims",
}
_POSITIONAL = {"integer_pow": "y"}


def unsupported_host_primitives(jaxpr: C.Jaxpr) -> set[str]:
    bad: set[str] = set()
    for e in jaxpr.eqns:
        body = C.inline_body(e)
        if body is not None:
            bad |= unsupported_host_primitives(body.jaxpr)
        elif e.primitive.name not in HOST_RULES:
            bad.add(e.primitive.name)
    return bad


def eval_host(jaxpr: C.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[np.ndarray]:
    """Evaluate ``jaxpr`` with numpy (the host backend's runtime)."""
    env: dict[Any, Any] = {}
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = np.asarray(x)
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = np.asarray(x)

    def read(a: Any) -> Any:
        return np.asarray(a.val) if C.is_literal(a) else env[a]

    for e in jaxpr.eqns:
        name = e.primitive.name
        ins = [read(a) for a in e.invars]
        body = C.inline_body(e)
        if body is not None:
            outs = eval_host(body.jaxpr, body.consts, ins)
        else:
            rule = HOST_RULES[name]
            if name in _PARAMS:
                out = rule(*ins, **e.params)
            elif name in _POSITIONAL:
                out = rule(*ins, e.params[_POSITIONAL[name]])
            else:
                out = rule(*ins)
            outs = [out]
        for v, o in zip(e.outvars, outs, strict=True):
            env[v] = np.asarray(o, dtype=shaped_aval(v).dtype)
    return [read(a) for a in jaxpr.outvars]


def check_results(
    region: str, backend: str, outs: Any, avals: Sequence[Any], *, coerce: bool = False
) -> list[Any]:
    """A backend's results, checked against the region's declared types: count, shape and kind
    of dtype exactly (never reshaped); ``coerce`` casts a numpy result of the same kind (a
    float64 from host arithmetic) to the declared dtype."""
    want = ", ".join(f"{np.dtype(a.dtype).name}{list(a.shape)}" for a in avals)
    if hasattr(outs, "shape"):
        raise BackendError(
            f"backend {backend!r} returned one array for region {region!r}, which declares "
            f"{len(avals)} result(s): {want}; a backend returns a sequence of the region's "
            "results (a list, also of one)"
        )
    outs = list(outs)
    if len(outs) != len(avals):
        raise BackendError(
            f"backend {backend!r} returned {len(outs)} result(s) for region {region!r}, which "
            f"declares {len(avals)}: {want}"
        )
    checked = []
    for i, (o, a) in enumerate(zip(outs, avals, strict=True)):
        dtype = np.dtype(o.dtype) if hasattr(o, "dtype") else np.asarray(o).dtype
        shape = tuple(np.shape(o))
        same_kind = dtype.kind == np.dtype(a.dtype).kind and (coerce or dtype == a.dtype)
        if shape != tuple(a.shape) or not same_kind:
            raise BackendError(
                f"backend {backend!r} returned {dtype.name}{list(shape)} as result {i} of region "
                f"{region!r}, which declares {np.dtype(a.dtype).name}{list(a.shape)}; a backend "
                "must return exactly the region's types"
            )
        checked.append(np.asarray(o, dtype=a.dtype) if coerce else o)
    return checked


def callback_runner(region: Program, host_fn: Callable[..., Sequence[Any]]) -> Callable[..., Any]:
    """Run ``host_fn`` (numpy in, numpy out) as the region's implementation through
    ``jax.pure_callback``; a failure inside names the region."""
    result = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in region.jaxpr.out_avals]

    def host(*args: Any) -> list[np.ndarray]:
        try:
            outs = host_fn(*args)
        except Exception as e:
            raise BackendError(
                f"region {region.name!r} failed on its backend: {type(e).__name__}: {e}"
            ) from e
        return check_results(region.name, "host function", outs, result, coerce=True)

    def run(*args: Any) -> Sequence[Any]:
        return jax.pure_callback(host, result, *args, vmap_method="sequential")

    return run


def host_codegen(region: Program) -> Callable[..., Sequence[Any]]:
    closed = region.jaxpr
    bad = unsupported_host_primitives(closed.jaxpr)
    if bad:
        raise BackendError(
            f"the host backend cannot run region {region.name!r}: no numpy rule for "
            f"{sorted(bad)} (it has rules for {len(HOST_RULES)} primitives, see "
            "jaxq.partition.backend_ops('host'))"
        )
    consts = [np.asarray(c) for c in closed.consts]
    return callback_runner(region, lambda *args: eval_host(closed.jaxpr, consts, args))


register_backend("xla", xla_backend())
register_backend("host", host_codegen)
