"""`simulated_quantize`: fake quantization from core ops, with a straight-through gradient.

The value is `(clip(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale`, computed in
at least float32 and cast back to `x.dtype`. `scale` and `zero_point` are operands, not params, so
calibration can feed traced values; everything else is a static param that prints in the jaxpr.

Inside the primitive, `scale` and `zero_point` may carry leading dimensions that line up with the
leading dimensions of `x`: that is how batched scales are represented after `vmap`. The public
wrapper only lets users pass scalars or 1-D vectors along `axis`.
"""

import numbers
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.typing import ArrayLike

from jaxq._compat import is_tracer

from ._identity import as_array

Kind = Literal["input", "weight", "activation"]
Rounding = Literal["nearest_even", "half_away_from_zero", "half_up", "floor"]
Ste = Literal["identity", "clipped"]

KINDS: tuple[str, ...] = ("input", "weight", "activation")
ROUNDINGS: tuple[str, ...] = ("nearest_even", "half_away_from_zero", "half_up", "floor")
STES: tuple[str, ...] = ("identity", "clipped")


def quant_range(bits: int, signed: bool = True, narrow_range: bool = False) -> tuple[int, int]:
    """The integer range `(qmin, qmax)` of a `bits`-wide code.

    `narrow_range` drops the lowest code, making a signed range symmetric (`[-127, 127]` for 8
    bits); for unsigned codes it gives `[1, 2**bits - 1]`, TensorFlow's convention.
    """
    if signed:
        qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    else:
        qmin, qmax = 0, 2**bits - 1
    return qmin + int(narrow_range), qmax


def _half_up(v: jax.Array) -> jax.Array:
    # floor(v + 0.5) rounds 0.49999997 up in float32; comparing the exact fraction does not.
    f = jnp.floor(v)
    return f + (v - f >= 0.5).astype(v.dtype)


_ROUND: dict[str, Any] = {
    # lax ops, not jnp's (each a nested jit): fewer equations to trace and lower per layer
    "nearest_even": lambda v: lax.round(v, lax.RoundingMethod.TO_NEAREST_EVEN),
    "half_away_from_zero": lambda v: lax.round(v, lax.RoundingMethod.AWAY_FROM_ZERO),
    "half_up": _half_up,
    "floor": lax.floor,
}


def _expand(v: jax.Array, ndim: int, axis: int | None, group_size: int | None) -> jax.Array:
    """Reshape a scale or zero point so that it broadcasts against an `ndim`-D `x`.

    Leading dims of `v` align with the leading dims of `x`; with `axis`, the last dim of `v` runs
    along `axis` (one entry per group of `group_size` consecutive elements when grouped).
    """
    if axis is None:
        return v.reshape(v.shape + (1,) * (ndim - v.ndim))
    if group_size is not None:
        v = jnp.repeat(v, group_size, axis=-1)
    lead = v.ndim - 1
    shape = v.shape[:lead] + (1,) * (axis - lead) + v.shape[-1:] + (1,) * (ndim - axis - 1)
    return v.reshape(shape)


def _fake_quant(
    x: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array,
    *,
    bits: int,
    signed: bool,
    kind: str,
    rounding: str,
    axis: int | None,
    group_size: int | None,
    narrow_range: bool,
    ste: str,
) -> jax.Array:
    """The value of `simulated_quantize`: its eager impl and its lowering, from core ops only."""
    del kind, ste  # metadata for passes and for the gradient; they do not change the value
    qmin, qmax = quant_range(bits, signed, narrow_range)
    # x * (1 / s), not x / s: XLA compiles a division by a constant scale as that product but
    # divides by one given at run time (realize's), one code apart at exact ties. jnp even for
    # numpy inputs (eager calls), the same arithmetic as compiled.
    x, scale, zero_point = jnp.asarray(x), jnp.asarray(scale), jnp.asarray(zero_point)
    s = _expand(scale, x.ndim, axis, group_size)
    zp = _expand(zero_point, x.ndim, axis, group_size)
    q = clamp(_ROUND[rounding](x.astype(s.dtype) * (1 / s)) + zp, qmin, qmax)
    return ((q - zp) * s).astype(x.dtype)


def clamp(v: jax.Array, lo: float, hi: float) -> jax.Array:
    """``jnp.clip(v, lo, hi)`` as one ``max`` and one ``min`` (no nested jit)."""
    return lax.min(lax.max(v, jnp.full((), lo, v.dtype)), jnp.full((), hi, v.dtype))


simulated_quantize_p = Primitive("simulated_quantize")
# The eager impl is the lowering, compiled once per shape and params as JAX's own primitives run
# eagerly (op by op, a new weight shape compiled each of its operations: seconds per weight).
_STATIC = ("bits", "signed", "kind", "rounding", "axis", "group_size", "narrow_range", "ste")
simulated_quantize_p.def_impl(jax.jit(_fake_quant, static_argnames=_STATIC))


def _abstract_eval(x: Any, scale: Any, zero_point: Any, **params: Any) -> Any:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"simulated_quantize: x must have a floating dtype; got {x.dtype}")
    return x


simulated_quantize_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(simulated_quantize_p, mlir.lower_fun(_fake_quant, multiple_results=False))


def _batch(args: Any, dims: Any, *, axis: int | None, **params: Any) -> tuple[jax.Array, int]:
    """Move every batch dim to the front; scales then gain a leading dim aligned with `x`'s.

    A batched scale is not per-channel along a user axis, but the primitive's leading-dims rule
    (see `_expand`) expresses it without a loop. `axis` shifts by one because `x` gained a dim.
    """
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    lead_free = 0 if axis is None else 1  # dims of scale / zero point that are not leading dims

    def to_front(a: jax.Array, d: int | None, is_x: bool) -> jax.Array:
        if d is not None:
            return jnp.moveaxis(a, d, 0)
        # An unbatched x, or an operand whose leading dims align with x's, must gain the new dim.
        if is_x or a.ndim > lead_free:
            return lax.broadcast(a, (size,))
        return a

    x, scale, zero_point = (
        to_front(a, d, i == 0) for i, (a, d) in enumerate(zip(args, dims, strict=True))
    )
    new_axis = None if axis is None else axis + 1
    return simulated_quantize_p.bind(x, scale, zero_point, axis=new_axis, **params), 0


batching.primitive_batchers[simulated_quantize_p] = _batch


def _jvp(primals: Any, tangents: Any, **params: Any) -> tuple[jax.Array, Any]:
    """Straight-through estimator: d/dx is 1 (or 1 inside the clip range); d/dscale, d/dzp are 0."""
    x, scale, zero_point = primals
    tx = tangents[0]
    y = simulated_quantize_p.bind(x, scale, zero_point, **params)
    if type(tx) is ad.Zero:  # (only the scale or zero point varies: a zero derivative)
        return y, jnp.zeros_like(y)
    if params["ste"] == "identity":
        return y, tx
    qmin, qmax = quant_range(params["bits"], params["signed"], params["narrow_range"])
    s = _expand(scale, x.ndim, params["axis"], params["group_size"])
    zp = _expand(zero_point, x.ndim, params["axis"], params["group_size"])
    xc = x.astype(s.dtype)
    inside = (xc >= (qmin - zp) * s) & (xc <= (qmax - zp) * s)
    return y, jnp.where(inside, tx, jnp.zeros_like(tx))


ad.primitive_jvps[simulated_quantize_p] = _jvp


def _is_concrete(v: ArrayLike) -> bool:
    return not is_tracer(v)


def _check_param(
    v: ArrayLike, what: str, n: int, axis: int | None, group_size: int | None, dtype: Any
) -> jax.Array:
    """Cast a scale or zero point to the compute dtype and check its shape against `x`."""
    v = jnp.asarray(v, dtype=dtype)
    if axis is None:
        if v.ndim != 0:
            raise ValueError(
                f"simulated_quantize: {what} must be a scalar when axis is None; "
                f"got shape {v.shape}"
            )
        return v
    if v.shape not in ((), (n,)):
        groups = "" if group_size is None else f" in groups of {group_size}"
        raise ValueError(
            f"simulated_quantize: {what} must have shape () or ({n},) along axis {axis}{groups}; "
            f"got shape {v.shape}"
        )
    return jnp.broadcast_to(v, (n,))


def simulated_quantize(
    x: ArrayLike,
    scale: ArrayLike,
    zero_point: ArrayLike = 0,
    *,
    bits: int = 8,
    signed: bool = True,
    kind: Kind = "activation",
    rounding: Rounding = "nearest_even",
    axis: int | None = None,
    group_size: int | None = None,
    narrow_range: bool = False,
    ste: Ste = "identity",
) -> jax.Array:
    """Fake-quantize `x`: quantize to `bits`-wide integers and dequantize again.

    `q = clip(round(x * (1 / scale)) + zero_point, qmin, qmax)`, result `(q - zero_point) * scale`,
    with `(qmin, qmax)` from `quant_range(bits, signed, narrow_range)`: a product with the float32
    reciprocal, eagerly too and in realized programs alike, so where `x / scale` is an exact tie
    in float32 numpy's `round(x / scale)` may be one code apart.

    Granularity: scalar `scale` / `zero_point` quantize per tensor. With `axis`, they are scalars or
    1-D vectors of length `x.shape[axis]` (per channel). With `axis` and `group_size=g`, the
    elements along `axis` are split into `x.shape[axis] // g` blocks of `g` consecutive elements,
    and entry `i` of the length-`x.shape[axis] // g` vectors applies to block `i` (indices
    `i*g ... i*g + g - 1` along `axis`) across all other axes.

    Rounding: `"nearest_even"` (ties to even), `"half_away_from_zero"`, `"half_up"` (ties towards
    +inf, i.e. `floor(v + 0.5)`, TVM's UPWARD) or `"floor"`. The rounding modes to nearest are
    idempotent; `"floor"` is only where `(q - zero_point) * scale / scale` is exact (e.g.
    power-of-two scales), as float rounding can leave it just below `q - zero_point`.

    Gradient (straight-through estimator), so quantization-aware training works with `jax.grad`:
    w.r.t. `x` it is the identity with `ste="identity"`, and with `ste="clipped"` it is zero where
    `x` lies outside `[(qmin - zero_point) * scale, (qmax - zero_point) * scale]`. W.r.t. `scale`
    and `zero_point` it is zero: they are calibrated, not learned.

    `kind` (`"input"`, `"weight"`, `"activation"`) does not change the value; it tells passes what
    is being quantized.
    """
    x = as_array(x, "simulated_quantize")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"simulated_quantize: x must have a floating dtype; got {x.dtype}")
    if not isinstance(bits, numbers.Integral) or isinstance(bits, (bool, np.bool_)):
        raise TypeError(f"simulated_quantize: bits must be an int; got {bits!r}")
    bits = int(bits)  # (a numpy integer too)
    if not 2 <= bits <= 16:
        raise ValueError(f"simulated_quantize: bits must be in [2, 16]; got {bits}")
    for name, flag in (("signed", signed), ("narrow_range", narrow_range)):
        if not isinstance(flag, bool):
            raise TypeError(f"simulated_quantize: {name} must be a bool; got {flag!r}")
    for name, value, allowed in (
        ("kind", kind, KINDS),
        ("rounding", rounding, ROUNDINGS),
        ("ste", ste, STES),
    ):
        if value not in allowed:
            raise ValueError(f"simulated_quantize: {name} must be one of {allowed}; got {value!r}")

    n = 0
    if axis is not None:
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise TypeError(f"simulated_quantize: axis must be an int or None; got {axis!r}")
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(
                f"simulated_quantize: axis must be in [{-x.ndim}, {x.ndim}) for x of shape "
                f"{x.shape}; got {axis}"
            )
        axis %= x.ndim
        n = x.shape[axis]
    if group_size is not None:
        if not isinstance(group_size, int) or isinstance(group_size, bool):
            raise TypeError(f"simulated_quantize: group_size must be an int; got {group_size!r}")
        if axis is None:
            raise ValueError(
                f"simulated_quantize: group_size requires an axis; got axis=None with "
                f"group_size={group_size}"
            )
        if group_size <= 0 or n % group_size:
            raise ValueError(
                f"simulated_quantize: group_size must divide x.shape[{axis}] = {n}; "
                f"got {group_size}"
            )
        n //= group_size

    dtype = jnp.promote_types(x.dtype, jnp.float32)
    scale = _check_param(scale, "scale", n, axis, group_size, dtype)
    zero_point = _check_param(zero_point, "zero_point", n, axis, group_size, dtype)
    qmin, qmax = quant_range(bits, signed, narrow_range)
    if _is_concrete(scale):
        s = np.asarray(scale)
        bad = s[~(np.isfinite(s) & (s > 0))]
        if bad.size:
            raise ValueError(f"simulated_quantize: scale must be positive and finite; got {bad[0]}")
    if _is_concrete(zero_point):
        z = np.asarray(zero_point)
        bad = z[~((z == np.round(z)) & (z >= qmin) & (z <= qmax))]
        if bad.size:
            raise ValueError(
                f"simulated_quantize: zero_point must be an integer in [{qmin}, {qmax}]; "
                f"got {bad[0]}"
            )
    return simulated_quantize_p.bind(
        x,
        scale,
        zero_point,
        bits=bits,
        signed=signed,
        kind=kind,
        rounding=rounding,
        axis=axis,
        group_size=group_size,
        narrow_range=narrow_range,
        ste=ste,
    )
