"""The ``"onnxruntime"`` backend: export a region to ONNX and run it in ONNX Runtime.

A small exporter covers the ops regions usually hold (elementwise arithmetic and activations,
``dot_general`` as ``MatMul``, convolutions, max and sum (average) pooling, pads, broadcasts,
reshapes, transposes, slices, concatenations, casts, reductions, ``select_n``); nested ``jit`` /
``custom_jvp_call`` bodies (composites, ``jax.nn.relu``) are inlined. Integer code as realize
writes it maps onto ONNX's integer kernels: an int8 x int8 -> int32 ``dot_general`` becomes
``MatMulInteger`` and an int8 convolution im2col + ``MatMulInteger``, their int8 activations
shifted by 128 into uint8 with a zero point of 128 (exact: ``sum((a + 128 - 128) w) = sum(a w)``),
the operand type ONNX Runtime's x86 kernels run fast (on x86 without VNNI, whose uint8 x int8
kernels add pairs of products in int16 with saturation, the int8 weights are shifted too: uint8 x
uint8 is exact there). Pattern rules write realize's idioms as ONNX
Runtime's fused kernels where they compute the same numbers (or within float rounding): its
quantize as ``QuantizeLinear``, an int8 dot with its zero-point term, float rescale and bias as
``com.microsoft.MatMulIntegerToFloat`` (the zero-point term checked on the weights' values),
``jax.nn.gelu`` as ``Gelu`` / ``FastGelu``, a layer norm as ``LayerNormalization``, and a row's NaN
check (``any(not finite(x))``, realize's ``max|x| * 0``) as ``sum(x * 0)``, which keeps NaN where
ONNX Runtime's ``ReduceMax`` drops it (as ``sum(x)`` where ``x`` is bounded, or an earlier layer's
NaN row where it provably has the same). Unless ``exact``, a convolution that requantizes straight
to the next layer's codes becomes one ``QLinearConv``, which rounds that requantize in float (each
code realize's or one step from it). XLA calls the session through an FFI call on its own buffers
(``_ort_ffi``) or ``jax.pure_callback``, so a built program stays jittable. Needs the optional
packages ``onnx`` and ``onnxruntime`` (``pip install jaxq[onnx]``).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from jaxq import _compat as C
from jaxq import _cpu
from jaxq._program import Program
from jaxq.partition import _ort_ffi
from jaxq.partition._backends import BackendError, callback_runner, register_backend, shaped_aval

OPSET = 18

_UNARY = {
    "neg": "Neg", "sin": "Sin", "cos": "Cos", "tanh": "Tanh", "exp": "Exp", "log": "Log",
    "abs": "Abs", "sqrt": "Sqrt", "logistic": "Sigmoid", "sign": "Sign", "erf": "Erf",
    "floor": "Floor", "ceil": "Ceil",
}  # fmt: skip
_BINARY = {
    "add": "Add", "add_any": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max",
    "min": "Min", "pow": "Pow", "gt": "Greater", "lt": "Less", "ge": "GreaterOrEqual", "le": "LessOrEqual",
    "eq": "Equal",
}  # fmt: skip
_OTHER = {
    "dot_general", "broadcast_in_dim", "reshape", "transpose", "convert_element_type",
    "reduce_sum", "reduce_max", "reduce_min", "integer_pow", "select_n", "squeeze",
    "expand_dims", "rsqrt", "square", "round", "clamp", "conv_general_dilated",
    "reduce_window_max", "reduce_window_sum", "pad", "is_finite", "not", "and", "or", "reduce_or",
    "reduce_and", "concatenate", "stack", "slice", "split", "ne", "erfc",
}  # fmt: skip
_IDENTITY = ("copy", "copy_p", "stop_gradient", "name")  # (name: checkpoint_name's)
_OTHER |= set(_IDENTITY)
_INT8 = (np.dtype(np.int8), np.dtype(np.uint8))
ONNX_PRIMITIVES: frozenset[str] = frozenset(_UNARY.keys() | _BINARY.keys() | _OTHER)
"""Every primitive the exporter has a rule for (``jaxq.partition.backend_ops`` reads it)."""


_NAN_ROW_MATMUL_MIN = (1024, 2**18)
"""Rows at least this wide, in a tensor at least this large, get their NaN check as
``x @ zeros`` (measured with ONNX Runtime 1.32: 154 us against 275 us for ``sum(x * 0)`` on
512 x 1536, 63 against 57 us on 512 x 384; on 32 x 1536, a MiniLM token batch of one, the
region was 0.1 ms slower with it)."""

_SCALED_NORM_MAX_ROWS = 32
"""A layer norm's output times constant columns becomes a second ``LayerNormalization`` (see
scaled_norm) in tensors of at most this many rows: with ONNX Runtime 1.32 on 2 cores, MiniLM's
W8A8+SmoothQuant region (12 such products) ran 1.020x faster at 32 rows (one 32-token sentence,
95% 1.016-1.023), 1.004x at 64, and 0.988x / 0.983x at 128 / 512, where a multiply is the
cheaper pass."""

_QLINEAR_CONV_MIN_CHANNELS = 4
"""Convolutions on fewer input channels get channels of zero-point codes (and zero weights) up to
this many: ONNX Runtime 1.32's 3x3 ``QLinearConv`` from 1 channel to 16 took 0.43 ms at batch 256
on 8 x 8, from 4 channels 0.17 ms."""

_RESHAPES = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims")
_SHAPE_OPS = (*_RESHAPES, "transpose", "convert_element_type")
_SHIFT_COMMUTING = (*_RESHAPES, "transpose", "slice", "concatenate", "copy", "copy_p")
"""Ops whose uint8 twin (``x + 128``) is the same op on the twins."""


def _pooled_axes(p: Any) -> list[int]:
    """The axes a ``reduce_window_max`` / ``_sum`` pools over (a window or stride other than 1)."""
    windows = zip(p["window_dimensions"], p["window_strides"], strict=True)
    return [i for i, (w, s) in enumerate(windows) if w != 1 or s != 1]


def _limit(e: C.JaxprEqn) -> str | None:
    """Why the exporter cannot take this equation of a primitive it knows (None: it can)."""
    name, p = e.primitive.name, e.params
    dtypes = [np.dtype(shaped_aval(v).dtype) for v in e.invars]
    outs = [np.dtype(shaped_aval(v).dtype) for v in e.outvars]
    if any(d.name in ("bfloat16", "float16") for d in (*dtypes, *outs)):
        return "16-bit float values (the exporter writes float32 and 8-bit integers)"
    if any(d.name in ("int4", "uint4") for d in (*dtypes, *outs)):
        return "4-bit integer values (ONNX Runtime's kernels do not take them)"
    if any(d.kind == "c" for d in (*dtypes, *outs)):
        return "complex values (ONNX Runtime's kernels do not take them)"
    if name == "split" and 0 in p["sizes"]:
        return "a split with an empty piece"
    if name == "select_n" and len(e.invars) != 3:
        return "select_n with more than two cases"
    if name == "round" and int(p["rounding_method"]) != 1:
        return "round away from zero (ONNX rounds half to even)"
    if name == "neg" and np.issubdtype(dtypes[0], np.unsignedinteger):
        return "neg of unsigned integers (ONNX Runtime's Neg takes signed types)"
    kernels = _ORT_DTYPES.get(name)
    if kernels is not None and dtypes[-1].name not in kernels:
        return f"{name} on {dtypes[-1].name} (ONNX Runtime's kernel takes {', '.join(kernels)})"
    ints = [np.issubdtype(d, np.integer) for d in dtypes]
    plain = name in ("div", "rem") and _plain_divisor(e.invars[1])
    if name == "rem" and ints[0] and not plain:
        return "integer rem by a divisor that may be 0 (XLA gives x, ONNX Runtime fails)"
    if name == "div" and ints[0] and not plain and dtypes[0].name not in ("int32", "int64"):
        return f"{dtypes[0].name} div by a divisor that may be 0 (XLA gives -1, ONNX Runtime fails)"
    eight_bit = all(d in _INT8 for d in dtypes)
    if name == "dot_general" and any(ints) and not eight_bit:
        return "an integer dot_general on other than 8-bit operands"
    if name == "conv_general_dilated":
        if any(d != 1 for d in p["lhs_dilation"]) or p["batch_group_count"] != 1:
            return "a convolution with input dilation or batch groups"
        if any(lo < 0 or hi < 0 for lo, hi in p["padding"]):
            return "a convolution with negative padding"
        if any(ints) and not eight_bit:
            return "an integer convolution on other than 8-bit operands"
    if name in ("reduce_window_max", "reduce_window_sum"):
        kind = "max" if name == "reduce_window_max" else "sum"
        pooled = _pooled_axes(p)
        if not pooled or len(pooled) == len(p["window_dimensions"]):
            return f"{kind} pooling that leaves no axis unpooled, or pools none"
        if any(p["padding"][i] != (0, 0) for i in range(len(p["padding"])) if i not in pooled):
            return f"{kind} pooling that pads an axis it does not pool"
        if any(d != 1 for d in (*p["base_dilation"], *p["window_dilation"])):
            return f"dilated {kind} pooling"
        window = p["window_dimensions"]
        if any(max(pad) >= w for pad, w in zip(p["padding"], window, strict=True) if w > 1):
            return f"{kind} pooling padded by a window or more (ONNX Runtime refuses it)"
        if kind == "sum" and not np.issubdtype(dtypes[0], np.floating):
            return "integer sum pooling"
    if name == "pad" and any(lo < 0 or hi < 0 or i for lo, hi, i in p["padding_config"]):
        return "a pad with interior or negative padding"
    return None


_ORT_DTYPES: dict[str, tuple[str, ...]] = {
    name: kinds
    for names, kinds in (
        (("reduce_sum",), ("float32", "float64", "int32", "int64", "uint64")),
        (("reduce_max", "reduce_min"), ("float32", "float64", "int8", "uint8", "int32", "int64")),
        (("max", "min", "clamp", "select_n"), ("float32", "float64", "int8", "uint8", "int32",
                                                "uint32", "int64", "uint64")),
        (("lt", "le", "gt", "ge", "dot_general"), ("float32", "float64", "int8", "uint8", "int16",
                                                   "uint16", "int32", "uint32", "int64", "uint64")),
        (("reduce_window_max",), ("float32", "float64", "int8", "uint8")),
        (("pad",), ("bool", "float32", "float64", "int8", "uint8", "int32", "uint32", "int64",
                    "uint64")),
    )
    for name in names
}  # fmt: skip
"""The dtypes (of the last operand) ONNX Runtime's CPU kernels take, for the primitives whose
kernels do not take every dtype the exporter writes (measured on onnxruntime 1.32: the others
fail to open the model)."""


@functools.cache
def _u8s8_exact() -> bool:
    """Whether ONNX Runtime's uint8 x int8 kernels sum exactly on this machine. On x86 without
    VNNI they add pairs of products in int16 with saturation (``vpmaddubsw``: 255 * 127 * 2 >
    32767), seen as wrong sums on an AVX2 EPYC; VNNI's and ARM's kernels widen first."""
    # (unknown x86: False, the uint8 x uint8 kernels are exact everywhere)
    return not _cpu.is_x86() or bool(_cpu.x86_vnni())


def _plain_divisor(v: Any) -> bool:
    """Whether an integer division by ``v`` needs no guard: a literal other than 0 and +-1
    (XLA defines x / 0 and INT_MIN / -1; ONNX Runtime fails or traps on them)."""
    return C.is_literal(v) and bool(np.all(np.abs(np.asarray(v.val).astype(float)) > 1))


def _columns(v: np.ndarray, shape: Sequence[int], axes: Sequence[int]) -> np.ndarray | None:
    """``v``, broadcast against ``shape``, as one value per column along ``axes`` (increasing),
    flattened (one value as it is), where it is constant along the other axes (a multi-head
    projection's scales per head, ``[1, 1, heads, 1]``, against ``[b, t, heads, head_dim]`` along
    the last two); else None."""
    if v.size == 1:
        return v.reshape(())
    if v.ndim > len(shape):
        if any(d != 1 for d in v.shape[: v.ndim - len(shape)]):
            return None
        v = v.reshape(v.shape[v.ndim - len(shape) :])
    v = v.reshape((1,) * (len(shape) - v.ndim) + v.shape)
    if any(
        d not in ((1, n) if a in axes else (1,))
        for a, (d, n) in enumerate(zip(v.shape, shape, strict=True))
    ):
        return None
    cols = [shape[a] for a in axes]
    return np.broadcast_to(v.reshape([v.shape[a] for a in axes]), cols).reshape(-1)


def unsupported_onnx_equation(e: C.JaxprEqn) -> set[str]:
    """What the exporter cannot take in one equation (the calls it inlines, recursively):
    primitive names, or why; empty when it takes all of it."""
    body = C.inline_body(e)
    if body is not None:
        return unsupported_onnx_primitives(body.jaxpr)
    if e.primitive.name not in ONNX_PRIMITIVES:
        return {e.primitive.name}
    why = _limit(e)
    return set() if why is None else {why}


def unsupported_onnx_primitives(jaxpr: C.Jaxpr) -> set[str]:
    """What the exporter cannot take in ``jaxpr``: primitive names, or why (an empty set: all)."""
    return set().union(*(unsupported_onnx_equation(e) for e in jaxpr.eqns))


_BROADCASTING = {*_BINARY, "select_n", "clamp", "and", "or", "ne"}


def _broadcast_only(jaxpr: C.Jaxpr) -> set[Any]:
    """The values of ``jaxpr`` used only by ops that broadcast operands of equal rank (ONNX's
    elementwise ops do), and not as outputs."""
    users: dict[Any, set[str]] = {}
    for e in jaxpr.eqns:
        rank = len(shaped_aval(e.outvars[0]).shape)
        for v in e.invars:
            if not C.is_literal(v):
                same_rank = len(shaped_aval(v).shape) == rank
                users.setdefault(v, set()).add(e.primitive.name if same_rank else "")
    outs = {v for v in jaxpr.outvars if not C.is_literal(v)}
    skip = {v for v, us in users.items() if us <= _BROADCASTING and v not in outs}
    # an op whose operands would all be left unexpanded would compute a smaller result: keep one
    # operand of the output's shape expanded there (one pass suffices: keeping only adds shapes)
    for e in jaxpr.eqns:
        shape = shaped_aval(e.outvars[0]).shape
        full = [v for v in e.invars if not C.is_literal(v) and shaped_aval(v).shape == shape]
        if full and all(v in skip for v in full):
            skip.discard(full[0])
    return skip


class _NoMatch(Exception):
    """A pattern rule does not apply (the equation is exported op by op)."""


class _Uses:
    """Who produces each value of a jaxpr and who reads it (the pattern rules ask)."""

    def __init__(self, eqns: Sequence[C.JaxprEqn] = (), outvars: Sequence[Any] = ()) -> None:
        self.producer = {v: e for e in eqns for v in e.outvars}
        self.count = C.use_counts(eqns, outvars)  # (an output counts: never fused away)
        self.readers: dict[Any, list[C.JaxprEqn]] = {}
        for e in eqns:
            for v in e.invars:
                if not C.is_literal(v):
                    self.readers.setdefault(v, []).append(e)
        self.reader = {v: es[-1] for v, es in self.readers.items()}

    def made_by(self, v: Any, *names: str) -> C.JaxprEqn | None:
        """The equation that produced ``v``, if it is one of ``names``."""
        e = None if C.is_literal(v) else self.producer.get(v)
        return e if e is not None and e.primitive.name in names else None

    def only_read_through(self, v: Any, ops: Sequence[str], last: Callable[..., bool]) -> bool:
        """Whether every use of ``v`` reaches, through equations in ``ops``, an equation for
        which ``last(eqn, value)`` holds (``v`` is not an output)."""
        users = self.readers.get(v, [])
        if not users or self.count.get(v) != sum(e.invars.count(v) for e in users):
            return False
        return all(
            self.only_read_through(e.outvars[0], ops, last)
            if e.primitive.name in ops
            else last(e, v)
            for e in users
        )

    def sole_user(self, v: Any, *names: str) -> C.JaxprEqn | None:
        """The one equation reading ``v``, if only one does and it is one of ``names``."""
        e = self.reader.get(v) if self.count.get(v) == 1 else None
        return e if e is not None and e.primitive.name in names else None


class _Exporter:
    def __init__(self, onnx: Any, fuse: bool = True, exact: bool = False) -> None:
        self.onnx, self.helper = onnx, onnx.helper
        self.fuse = fuse
        """Whether ONNX Runtime's fused ``com.microsoft`` kernels may be written."""
        self.exact = exact
        """Whether every integer must equal realize's (no ``QLinearConv``: see requantized_conv)."""
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.count = 0
        self.consts: dict[Any, str] = {}
        self.values: dict[str, np.ndarray] = {}
        """The initializers' values by name (weight layouts are folded into new ones)."""
        self.float_codes: dict[str, tuple[str, Any]] = {}
        """int8 values cast from float: the float value and its dtype (see shifted_u8)."""
        self.negations: dict[str, str] = {}
        """Values that are a ``Not`` of another: that other one."""
        self.unsigned: set[str] = set()
        """Values with no negative value and no -0 (an ``Abs``'s, reshaped or scaled)."""
        self.reshape_of: dict[str, str] = {}
        """Values a ``Reshape`` wrote: its input."""
        self.shape_of: dict[str, tuple[int, ...]] = {}
        """Known shapes: of values a ``Reshape`` to a constant shape wrote, and of elementwise
        results (``|.|``, ``+``, ``*``) of such values and scalars."""
        self.zero_or_nan: set[str] = set()
        """Values that hold only +-0 and NaN: NaN rows, and what reshapes, ``|.|`` and sums of
        them make."""
        self.written: dict[Any, list[str]] = {}
        """Nodes written: (op, inputs, output count, attributes) -> their outputs' names."""
        self.isnan_of: dict[str, str] = {}
        """Bool values that are ``IsNaN`` of a NaN row (NaN or zero, no other value), reshaped
        any way: that row."""
        self.broadcasting: set[Any] = set()
        """Values whose every use is an op that broadcasts numpy-style (no Expand needed)."""
        self.quantized: dict[str, tuple[str, str, Any]] = {}
        """int8 codes written by ``QuantizeLinear``: its input, scale and zero point (see
        shifted_u8)."""
        self.graph = _Uses()
        """Producers and use counts of the jaxpr being exported (the pattern rules read them)."""
        self.env: dict[Any, str] = {}
        self.done: dict[int, tuple[str, Any] | None] = {}
        """Equations a pattern rule already wrote: the name of their result and a value still to
        add to it where the equation stands (None: a value only the fused node read)."""
        self.contrib = False
        """Whether a node of ONNX Runtime's ``com.microsoft`` domain was written."""
        self.u8: dict[str, str] = {}
        """int8 values also written as uint8 ``value + 128`` (a ``QLinearConv``'s output, and
        what pads, ReLUs, pooling and reshapes make of it): that uint8 value (see shifted_u8)."""
        self.bounded: dict[Any, float] = {}
        """Float values whose finite elements are at most this in magnitude, proven on constants
        (a fused dot's output, a layer norm's, what GELU and constant scales make of them)."""
        self.rows: dict[Any, tuple[str, tuple[int, ...]]] = {}
        """Bounded values whose rows hold NaN or Inf exactly where this NaN row (name, shape) is
        NaN: a fused dot's output after realize's NaN row, what GELU and constant scales make of
        it."""
        self.same_rows: dict[Any, Any] = {}
        """Bounded values made by carry: the value they have their NaN rows from."""
        self.norms: dict[Any, tuple[str, np.ndarray, np.ndarray, float]] = {}
        """Values a ``LayerNormalization`` wrote: its centered input, scale, bias and epsilon."""
        self.finite_like: dict[Any, Any] = {}
        """Float values a fused requantize left unwritten, read only by ``is_finite``: the NaN row
        whose finiteness their elements share (None: finite everywhere, bounded on the weights)."""

    def fresh(self, hint: str = "v") -> str:
        self.count += 1
        return f"{hint}{self.count}"

    def const(self, value: Any, dtype: Any = None) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, hashlib.blake2b(arr.tobytes()).digest())
        if key in self.consts:  # (one name per constant value: ONNX Runtime's CSE merges the
            return self.consts[key]  # q, k and v projections' identical quantize chains)
        name = self.fresh("c")
        self.consts[key] = name
        self.inits.append(self.onnx.numpy_helper.from_array(arr, name))
        self.values[name] = arr
        return name

    def reshape(self, x: str, shape: Sequence[int]) -> str:
        if x in self.values:  # a constant (a weight): folded here, so it stays an initializer
            return self.const(self.values[x].reshape(shape))
        return self.node("Reshape", [x, self.const(list(shape), np.int64)])[0]

    def node(self, op: str, ins: list[str], n_out: int = 1, **attrs: Any) -> list[str]:
        """Write ``op`` and return its outputs' names; the names of values already written where
        the node would recompute one: the same op on the same inputs, a reshape to the shape a
        value has, ``|x|`` of a value with no sign, a NaN row times +0 (a NaN row is read by
        every layer it poisons, each time through realize's reshape, ``|.|`` and ``* 0``)."""
        src = ins[0] if ins else None
        target = self.values.get(ins[1]) if op == "Reshape" else None
        if target is not None and src in self.reshape_of and np.all(target != 0):
            ins = [self.reshape_of[src], ins[1]]  # (a reshape of a reshape: one reshape)
        shape = tuple(int(d) for d in target) if target is not None and np.all(target > 0) else None
        if shape is not None and self.shape_of.get(ins[0]) == shape:
            return [ins[0]]
        if op == "Abs" and src in self.unsigned:
            return [ins[0]]
        if op == "Mul" and len(ins) == 2:
            for x, c in ((ins[0], self.values.get(ins[1])), (ins[1], self.values.get(ins[0]))):
                if x in self.zero_or_nan and c is not None and c.ndim == 0 and _plus_zero(c):
                    return [x]
        key = (op, tuple(ins), n_out, tuple(sorted((k, repr(v)) for k, v in attrs.items())))
        if key in self.written:
            return list(self.written[key])
        outs = self.written[key] = [self.fresh() for _ in range(n_out)]
        self.nodes.append(self.helper.make_node(op, ins, outs, **attrs))
        if op == "Reshape":  # (the same values: what is known of them holds)
            self.reshape_of[outs[0]] = ins[0]
            if src in self.isnan_of:
                self.isnan_of[outs[0]] = self.isnan_of[src]
            if shape is not None:
                self.shape_of[outs[0]] = shape
        if op in ("Abs", "Add", "Mul"):  # (elementwise on values of one shape and scalars)
            scalar = lambda i: i in self.values and self.values[i].ndim == 0
            shapes = {self.shape_of.get(i) for i in ins if not scalar(i)}
            if len(shapes) == 1 and None not in shapes:
                self.shape_of[outs[0]] = shapes.pop()  # type: ignore[assignment]
        if (op in ("Reshape", "Abs") and src in self.zero_or_nan) or (
            op == "Add" and all(i in self.zero_or_nan for i in ins)
        ):
            self.zero_or_nan.add(outs[0])
        if (op == "Abs" or (op == "Reshape" and src in self.unsigned)) or (
            op == "Add" and all(i in self.unsigned for i in ins)
        ):
            self.unsigned.add(outs[0])
        elif op == "Mul" and len(ins) == 2 and any(i in self.unsigned for i in ins):
            other = self.values.get(ins[1] if ins[0] in self.unsigned else ins[0])
            if other is not None and np.all(other >= 0) and not np.any(np.signbit(other)):
                self.unsigned.add(outs[0])  # (|x| times a constant >= +0)
        return outs

    def run(self, jaxpr: C.Jaxpr, consts: Sequence[Any], args: Sequence[str]) -> list[str]:
        env: dict[Any, str] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = self.const(c)
        env.update(zip(jaxpr.invars, args, strict=True))
        self.broadcasting |= _broadcast_only(jaxpr)
        self.forget(v for e in jaxpr.eqns for v in e.outvars)
        outer = self.graph, self.env
        self.graph, self.env = _Uses(jaxpr.eqns, jaxpr.outvars), env

        def read(a: Any) -> str:
            if C.is_literal(a):
                return self.const(a.val, a.aval.dtype)
            return env[a]

        for e in jaxpr.eqns:
            if id(e) in self.done:
                fused = self.done.pop(id(e))
                if fused is not None:
                    out, late = fused
                    if late is not None:  # (computed after the fused node: added here)
                        out = self.node("Add", [out, read(late)])[0]
                        if e.outvars[0] in self.bounded:  # (a fused dot's: NaN where late is)
                            self.rows[e.outvars[0]] = (read(late), shaped_aval(late).shape)
                    env[e.outvars[0]] = out
                continue
            ins = [read(a) for a in e.invars]
            outs = self.eqn(e, ins)
            if (  # (a reshaped isnan of a NaN row, however the op was written: the same row)
                e.primitive.name in _RESHAPES
                and ins[0] in self.isnan_of
                and shaped_aval(e.outvars[0]).size == shaped_aval(e.invars[0]).size
            ):
                self.isnan_of[outs[0]] = self.isnan_of[ins[0]]
            env.update(zip(e.outvars, outs, strict=True))
            self.shadow(e, ins, outs)
        outs = [read(a) for a in jaxpr.outvars]
        self.graph, self.env = outer
        return outs

    def forget(self, variables: Iterable[Any]) -> None:
        """Drop what is known of ``variables``: a jitted function called twice inlines the same
        body (the same variables) twice, and what held at one call need not at the next."""
        for v in variables:
            for known in (self.bounded, self.rows, self.same_rows, self.norms, self.finite_like):
                known.pop(v, None)

    def reciprocal(self, a: Any, name: str, shape: Sequence[int]) -> str | None:
        """``1 / a`` where XLA divides a ``shape`` by ``a`` as a multiply by its reciprocal:
        ``a`` constant or broadcast to more elements (measured on XLA:CPU; a division by an
        array computed at run time, or only reshaped, divides). None: a true division."""
        known = self.value(a)
        if known is not None:
            with np.errstate(divide="ignore"):  # (1 / 0 is inf, as in XLA: x * inf is x / 0)
                return self.const(np.reciprocal(known))
        b = self.graph.made_by(a, "broadcast_in_dim")
        src = shaped_aval(a if b is None else b.invars[0]).shape
        return self.node("Reciprocal", [name])[0] if math.prod(src) < math.prod(shape) else None

    def value(self, a: Any) -> np.ndarray | None:
        """The value of a literal or of a constant (an initializer) of the current jaxpr, also
        reshaped or broadcast (where a rule looks ahead of the equations written so far)."""
        if C.is_literal(a):
            return np.asarray(a.val, a.aval.dtype)
        name = self.env.get(a)
        if name is not None and name in self.values:
            return self.values[name]
        e = self.graph.made_by(a, *_RESHAPES)  # (a constant reshaped or broadcast to a rank)
        v = None if e is None else self.value(e.invars[0])
        if e is None or v is None:
            return None
        shape = shaped_aval(e.outvars[0]).shape
        if e.primitive.name != "broadcast_in_dim":
            return v.reshape(shape)
        dims = e.params["broadcast_dimensions"]
        expanded = [1] * len(shape)
        for i, d in enumerate(dims):
            expanded[d] = v.shape[i]
        return np.broadcast_to(v.reshape(expanded), shape)

    def eqn(self, e: C.JaxprEqn, ins: list[str]) -> list[str]:
        name, p = e.primitive.name, e.params
        out_aval = shaped_aval(e.outvars[0])
        body = C.inline_body(e)
        if body is not None:
            self.forget(body.jaxpr.invars)
            for pair in zip(e.invars, body.jaxpr.invars, strict=True):
                self.carry(*pair, 1.0)  # (bounds and NaN rows across the call)
            outs = self.run(body.jaxpr, body.consts, ins)
            for pair in zip(body.jaxpr.outvars, e.outvars, strict=True):
                self.carry(*pair, 1.0)
            return outs
        if name in _IDENTITY:  # (no node: rules see through it)
            self.carry(e.invars[0], e.outvars[0], 1.0)
            return ins
        if name in _UNARY:
            return self.node(_UNARY[name], ins)
        if name == "mul" and self.fuse and (gelu := self.gelu(e)) is not None:
            self.contrib = True
            self.carry(gelu[1], e.outvars[0], 1.0)  # (|gelu(x)| <= |x|; NaN and +-Inf: NaN, Inf)
            return self.node(gelu[0], [self.name_of(gelu[1])], domain="com.microsoft")
        if name == "mul" and self.fuse and (norm := self.layer_norm(e)) is not None:
            return [norm]
        if name == "mul" and self.fuse and (norm := self.scaled_norm(e)) is not None:
            return [norm]
        if name in ("div", "mul") and self.fuse and (mean := self.mean(e)) is not None:
            return [mean]
        if name == "div" and self.fuse and (logits := self.softmax(e)) is not None:
            return self.node("Softmax", [self.name_of(logits)], axis=-1)
        known = [not C.is_literal(v) and v in self.bounded for v in e.invars]
        if name == "add" and all(known) and e.invars[0] is not e.invars[1]:
            self.add_rows(e)
        elif name in ("mul", "add") and any(known):
            i = 0 if known[0] else 1
            c = self.value(e.invars[1 - i])
            if c is not None and c.dtype == np.float32 and c.size and np.all(np.isfinite(c)):
                big = float(np.abs(c).max())
                self.carry(
                    e.invars[i], e.outvars[0], big if name == "mul" else 1.0, big * (name == "add")
                )
        wide_int = np.dtype(out_aval.dtype).name in ("int32", "int64")
        if name == "div" and wide_int and not _plain_divisor(e.invars[1]):
            return self.int_div(np.dtype(out_aval.dtype), *ins)
        if name == "div" and np.dtype(out_aval.dtype).kind == "f":
            inverse = self.reciprocal(e.invars[1], ins[1], out_aval.shape)
            if inverse is not None:
                return self.node("Mul", [ins[0], inverse])
        if name in _BINARY:
            return self.node(_BINARY[name], ins)
        if name == "rsqrt":
            return self.node("Reciprocal", self.node("Sqrt", ins))
        if name == "square":
            return self.node("Mul", [ins[0], ins[0]])
        if name == "integer_pow":
            y = p["y"]
            if y == 0 or (y < 0 and np.dtype(out_aval.dtype).kind != "f"):
                return self.node("Pow", [ins[0], self.const(y, shaped_aval(e.invars[0]).dtype)])
            # XLA's square-and-multiply: its rounding, and integers wrap (ONNX Pow saturates them,
            # takes no 8- or 16-bit ones, and is slow)
            out: str | None = None
            base, k = ins[0], abs(y)
            while k:
                if k & 1:
                    out = base if out is None else self.node("Mul", [out, base])[0]
                k >>= 1
                if k:
                    base = self.node("Mul", [base, base])[0]
            assert out is not None
            return self.node("Reciprocal", [out]) if y < 0 else [out]
        if name == "dot_general":
            return self.dot_general(e, ins)
        if name == "broadcast_in_dim":
            shape, dims = p["shape"], p["broadcast_dimensions"]
            expanded = [1] * len(shape)
            for i, d in enumerate(dims):
                expanded[d] = shaped_aval(e.invars[0]).shape[i]
            r = self.node("Reshape", [ins[0], self.const(expanded, np.int64)])
            if e.outvars[0] in self.broadcasting or expanded == list(shape):
                return r  # its users broadcast it themselves, or it only adds unit axes
            return self.node("Expand", [r[0], self.const(shape, np.int64)])
        if name in ("reshape", "squeeze", "expand_dims"):  # (of a constant: a constant)
            return [self.reshape(ins[0], out_aval.shape)]
        if name == "transpose":
            return self.node("Transpose", ins, perm=list(p["permutation"]))
        if name == "convert_element_type":
            q = self.quantize_linear(e)
            if q is not None:
                return [q]
            to = self.helper.np_dtype_to_tensor_dtype(np.dtype(p["new_dtype"]))
            src_dtype = np.dtype(shaped_aval(e.invars[0]).dtype)
            if np.issubdtype(np.dtype(p["new_dtype"]), np.integer) and src_dtype.kind == "f":
                info, bounds = np.iinfo(p["new_dtype"]), self.clamp_of(e.invars[0])
                if bounds is None or not info.min <= bounds[1] <= bounds[2] <= info.max:
                    return self.saturating_cast(ins[0], src_dtype, np.dtype(p["new_dtype"]), to)
            cast = self.node("Cast", ins, to=to)
            bounds = self.clamp_of(e.invars[0]) if np.dtype(p["new_dtype"]) == np.int8 else None
            if bounds is not None and src_dtype.kind == "f" and self.integral(bounds[0]):
                self.float_codes[cast[0]] = (ins[0], src_dtype)
            return cast
        src = self.magnitude_of(e.invars[0]) if name == "reduce_max" else None
        if src is not None and self.nan_row(e):
            # max|x| * 0 (realize's NaN row): ONNX Runtime's ReduceMax skips NaN, so it is
            # written as |sum(x * 0)|, NaN exactly where the row holds NaN or Inf, +0 elsewhere
            return [self.zero_sum(src, p["axes"], out_aval.shape)]
        times_zero = self.graph.made_by(e.invars[0], "mul") if name == "reduce_sum" else None
        if times_zero is not None and any(self.is_scalar(a, 0.0) for a in times_zero.invars):
            row = next((a for a in times_zero.invars if not self.is_scalar(a, 0.0)), None)
            if row is not None and shaped_aval(row).shape == shaped_aval(e.invars[0]).shape:
                return [self.zero_sum(row, p["axes"], out_aval.shape)]  # (a NaN check as a sum)
        if name in ("reduce_sum", "reduce_max", "reduce_min"):
            op = {"reduce_sum": "ReduceSum", "reduce_max": "ReduceMax", "reduce_min": "ReduceMin"}
            axes = self.const(list(p["axes"]), np.int64)
            return self.node(op[name], [ins[0], axes], keepdims=0)
        if name == "select_n" and self.fuse and ins[0] in self.isnan_of:
            # where(isnan(row), NaN, 0) of a NaN row is the row (its zeros made +0)
            if_false, if_true = (self.value(a) for a in e.invars[1:])
            if (
                if_false is not None
                and _plus_zero(if_false)
                and if_true is not None
                and np.all(np.isnan(if_true))
            ):
                nan_row = self.isnan_of[ins[0]]
                named = self.reshape(nan_row, out_aval.shape)
                return [named] if nan_row in self.unsigned else self.node("Abs", [named])
        if name == "select_n":
            which, f, t = ins
            if shaped_aval(e.invars[0]).dtype != np.bool_:
                which = self.node("Cast", [which], to=self.onnx.TensorProto.BOOL)[0]
            return self.node("Where", [which, t, f])
        if name == "round":  # (only half-to-even reaches here: see _limit)
            return self.node("Round", ins)
        if name == "clamp":  # lax.clamp(lo, x, hi)
            lo, x, hi = ins  # (XLA's order: where lo > hi, the result is hi)
            return self.node("Min", [self.node("Max", [x, lo])[0], hi])
        if name == "erfc":
            one = self.const(1, shaped_aval(e.invars[0]).dtype)
            return self.node("Sub", [one, self.node("Erf", ins)[0]])
        if name == "ne":
            return self.node("Not", self.node("Equal", ins))
        if name == "is_finite" and e.invars[0] in self.finite_like:
            rows = self.expand(self.nonfinite(e.invars[0]), out_aval.shape)
            finite = self.node("Not", [rows])
            self.negations[finite[0]] = rows
            return finite
        if name == "is_finite":  # (x - x is NaN exactly where x is NaN or infinite)
            bad = self.node("IsNaN", self.node("Sub", [ins[0], ins[0]]))
            finite = self.node("Not", bad)
            self.negations[finite[0]] = bad[0]
            return finite
        if name == "not" and ins[0] in self.negations:  # not(not(x)) is x
            return [self.negations[ins[0]]]
        if name in ("not", "and", "or"):
            logical = shaped_aval(e.outvars[0]).dtype == np.bool_
            logic_op = {"not": "Not", "and": "And", "or": "Or"}[name]
            return self.node(logic_op if logical else f"Bitwise{logic_op}", ins)
        if name == "reduce_or" and self.fuse:
            neg = self.graph.made_by(e.invars[0], "not")
            fin = self.graph.made_by(neg.invars[0], "is_finite") if neg is not None else None
            if fin is not None and fin.invars[0] in self.finite_like:
                nonfinite = self.nonfinite(fin.invars[0], p["axes"])
                row = self.finite_like[fin.invars[0]]
                shape = () if row is None else shaped_aval(row).shape
                rows = math.prod(d for i, d in enumerate(shape) if i not in p["axes"])
                if nonfinite in self.isnan_of and rows == out_aval.size:
                    return [self.reshape(nonfinite, out_aval.shape)]  # (the row has the out shape)
                # (a coarser row: a convolution's per sample read per position by a dense layer)
                return [self.expand(nonfinite, out_aval.shape)]
            if fin is not None:  # any(not finite(x)) as isnan(sum(x * 0)): two passes, not four
                nan_row = self.zero_sum(fin.invars[0], p["axes"], out_aval.shape)
                nonfinite = self.node("IsNaN", [nan_row])[0]
                self.isnan_of[nonfinite] = nan_row
                return [nonfinite]
        if name in ("reduce_or", "reduce_and") and all(
            shaped_aval(e.invars[0]).shape[a] == 1 for a in p["axes"]
        ):  # (over axes of one element: the same values)
            return [self.reshape(ins[0], out_aval.shape)]
        if name in ("reduce_or", "reduce_and"):  # as a max / min over 0 / 1 bytes
            u8 = self.node("Cast", ins, to=self.onnx.TensorProto.UINT8)
            axes = self.const(list(p["axes"]), np.int64)
            reduce_op = "ReduceMax" if name == "reduce_or" else "ReduceMin"
            reduced = self.node(reduce_op, [u8[0], axes], keepdims=0)
            return self.node("Cast", reduced, to=self.onnx.TensorProto.BOOL)
        if name == "concatenate":
            return self.node("Concat", ins, axis=int(p["dimension"]))
        if name == "stack":  # (jnp.stack; loops unrolled by unroll_loops stack their ys)
            axis = int(p["axis"]) % len(out_aval.shape)
            unit = [1 if d == axis else n for d, n in enumerate(out_aval.shape)]
            return self.node("Concat", [self.reshape(i, unit) for i in ins], axis=axis)
        if name == "split":  # (jnp.split: query / key / value, gates)
            sizes = self.const(list(p["sizes"]), np.int64)
            return self.node("Split", [ins[0], sizes], n_out=len(p["sizes"]), axis=int(p["axis"]))
        if name == "slice":
            n = len(p["start_indices"])
            steps = p["strides"] or (1,) * n
            args = [p["start_indices"], p["limit_indices"], range(n), steps]
            return self.node("Slice", [ins[0], *(self.const(list(a), np.int64) for a in args)])
        if name == "pad":  # (no interior or negative padding: see _limit)
            cfg = p["padding_config"]
            pads = [lo for lo, _, _ in cfg] + [hi for _, hi, _ in cfg]
            return self.node("Pad", [ins[0], self.const(pads, np.int64), ins[1]])
        if name == "conv_general_dilated":
            return self.conv(e, ins)
        if name == "reduce_window_max":
            return self.pool("MaxPool", e, ins)
        if name == "reduce_window_sum":  # (the mean of each window, zero padding counted, times
            # its size: a sum of the same terms in another order, within float rounding)
            mean = self.pool("AveragePool", e, ins, count_include_pad=1)[0]
            size = int(np.prod(e.params["window_dimensions"]))
            return self.node("Mul", [mean, self.const(size, shaped_aval(e.outvars[0]).dtype)])
        raise BackendError(f"the ONNX exporter has no rule for {name!r}")

    def name_of(self, a: Any) -> str:
        return self.const(a.val, a.aval.dtype) if C.is_literal(a) else self.env[a]

    def saturating_cast(self, x: str, src: np.dtype, dst: np.dtype, to: int) -> list[str]:
        """A float to integer Cast as XLA converts: NaN to 0, saturated at the integer type's
        range, truncated toward zero (ONNX leaves out-of-range casts undefined: ONNX Runtime
        gives INT_MIN for NaN and Inf, and wraps int8)."""
        info = np.iinfo(dst)
        hi = np.array(info.max, src)
        if float(hi) > info.max:  # (int32's max is 2**31 in float32: clip below it)
            hi = np.nextafter(hi, np.array(-np.inf, src))
        zero = self.const(0, src)
        clean = self.node("Where", [self.node("IsNaN", [x])[0], zero, x])[0]
        lo_c, hi_c = self.const(info.min, src), self.const(hi, src)
        cast = self.node("Cast", self.node("Clip", [clean, lo_c, hi_c]), to=to)
        if float(hi) == info.max:
            out = cast
        else:  # at or above the type's max: the max itself
            top = self.node("GreaterOrEqual", [clean, self.const(float(info.max), src)])[0]
            out = self.node("Where", [top, self.const(info.max, dst), cast[0]])
        return out

    def int_div(self, dt: np.dtype, a: str, b: str) -> list[str]:
        """XLA's integer division: truncated toward zero, as ONNX's ``Div``, and ``x / 0 = -1``,
        ``INT_MIN / -1 = INT_MIN``, where ONNX Runtime's ``Div`` fails or traps: those divisors
        become 1 and the results are chosen after."""
        zero = self.node("Equal", [b, self.const(0, dt)])[0]
        lowest = self.node("Equal", [a, self.const(np.iinfo(dt).min, dt)])[0]
        minus = self.node("Equal", [b, self.const(-1, dt)])[0]
        bad = self.node("Or", [zero, self.node("And", [lowest, minus])[0]])[0]
        q = self.node("Div", [a, self.node("Where", [bad, self.const(1, dt), b])[0]])[0]
        return self.node("Where", [zero, self.const(-1, dt), q])

    def integral(self, v: Any) -> bool:
        """Whether ``v`` holds whole numbers (or NaN / Inf): rounded, an integer converted, or
        such values plus or minus whole constants (realize's ``round(x / s) + zp``)."""
        c = self.value(v)
        if c is not None:
            return bool(np.all(np.isnan(c) | (np.round(c) == c)))
        e = self.graph.made_by(v, "round", "floor", "ceil", "convert_element_type", "add", "sub")
        if e is None:
            return False
        if e.primitive.name == "convert_element_type":
            return np.issubdtype(np.dtype(shaped_aval(e.invars[0]).dtype), np.integer)
        if e.primitive.name in ("add", "sub"):
            return all(self.integral(a) for a in e.invars)
        return True

    def is_scalar(self, a: Any, want: float) -> bool:
        v = self.value(a)
        return v is not None and v.size == 1 and float(v.reshape(())) == want

    def clamped(self, v: Any, lo: float, hi: float) -> Any:
        """``x`` where ``v`` is ``x`` clamped to ``[lo, hi]`` (``lax.clamp``, ``jnp.clip``, or
        ``min`` and ``max`` in either order), else None."""
        found = self.clamp_of(v)
        return found[0] if found is not None and found[1:] == (lo, hi) else None

    def clamp_of(self, v: Any) -> tuple[Any, float, float] | None:
        """``(x, lo, hi)`` where ``v`` is ``x`` clamped to constant bounds, else None."""
        g = self.graph
        scalar = lambda a: (lambda c: None if c is None or c.size != 1 else float(c.reshape(())))(
            self.value(a)
        )
        e = g.made_by(v, "clamp")
        if e is not None:
            lo, hi = scalar(e.invars[0]), scalar(e.invars[2])
            return None if lo is None or hi is None else (e.invars[1], lo, hi)
        e = g.made_by(v, "jit", "pjit")
        if e is not None and C.call_name(e) == "clip" and len(e.invars) == 3:
            lo, hi = scalar(e.invars[1]), scalar(e.invars[2])
            return None if lo is None or hi is None else (e.invars[0], lo, hi)
        for outer, inner in (("min", "max"), ("max", "min")):
            e = g.made_by(v, outer)
            if e is None:
                continue
            for i in (0, 1):
                f = g.made_by(e.invars[i], inner)
                first = scalar(e.invars[1 - i])
                if f is None or first is None:
                    continue
                for j in (0, 1):
                    second = scalar(f.invars[1 - j])
                    if second is not None:
                        lo, hi = (second, first) if outer == "min" else (first, second)
                        return f.invars[j], lo, hi
        return None

    def quantize_form(self, e: C.JaxprEqn) -> tuple[Any, Any, Any] | None:
        """For realize's quantize, ``clamp(round(x * r) + zp, lo, hi)`` cast to 8 bits (through
        int32 or not, clamped to the full range), ``r = 1 / s`` computed or constant: ``x``,
        ``r`` and ``zp`` (None: no zero point). None: not that pattern."""
        to = np.dtype(e.params["new_dtype"])
        g = self.graph
        v = e.invars[0]
        wide = g.made_by(v, "convert_element_type")
        if wide is not None and np.dtype(shaped_aval(v).dtype) == np.int32:
            v = wide.invars[0]
        if to not in _INT8 or np.dtype(shaped_aval(v).dtype) != np.float32:
            return None
        v = self.clamped(v, np.iinfo(to).min, np.iinfo(to).max)
        zp: Any = None
        add = None if v is None else g.made_by(v, "add")
        if add is not None:
            i = 0 if g.made_by(add.invars[0], "round") else 1
            v, zp = add.invars[i], add.invars[1 - i]
        rnd = None if v is None else g.made_by(v, "round")
        mul = g.made_by(rnd.invars[0], "mul") if rnd is not None else None
        if mul is None or int(rnd.params["rounding_method"]) != 1:  # type: ignore[union-attr]
            return None
        x, inverse = mul.invars
        div = g.made_by(inverse, "div")
        if self.value(inverse) is None and (div is None or not self.is_scalar(div.invars[0], 1)):
            return None
        scalars = [a for a in (inverse, zp) if a is not None]
        if any(shaped_aval(a).shape != () or shaped_aval(a).dtype != np.float32 for a in scalars):
            return None
        return x, inverse, zp

    def inverse_value(self, inverse: Any) -> np.ndarray | None:
        """The value of a quantize's ``1 / s`` (see quantize_form), where it is known."""
        known = self.value(inverse)
        if known is not None:
            return known
        s = self.value(self.graph.made_by(inverse, "div").invars[1])  # type: ignore[union-attr]
        return None if s is None else np.float32(1) / s.astype(np.float32)

    def quantize_linear(self, e: C.JaxprEqn) -> str | None:
        """Realize's quantize (see quantize_form) as one ``QuantizeLinear``, which computes
        ``clamp(round(x / s), lo - zp, hi - zp) + zp``: the same integers for an integer zp (NaN
        inputs give other codes, which realize's NaN rows override). The product with the
        reciprocal is written as realize computes it and quantized with a scale of 1: a
        division rounds near-ties apart (85.49999 against 86). Codes of int8 are recorded
        so that a dot's uint8 operand is the same node with its zero point moved by 128 (see
        shifted_u8). None: not that pattern."""
        form = self.quantize_form(e)
        if form is None:
            return None
        x, inverse, zp = form
        to = np.dtype(e.params["new_dtype"])
        known = np.zeros((), np.float32) if zp is None else self.value(zp)
        if known is not None:
            if float(known) != round(float(known)):
                return None
            zp_ref: Any = np.asarray(known, np.int16)
            zp_name = self.const(zp_ref, to)
        else:
            zp_ref = self.name_of(zp)
            zp_name = self.node("Cast", [zp_ref], to=self.helper.np_dtype_to_tensor_dtype(to))[0]
        r = self.inverse_value(inverse)
        if r is None:
            # (1 / s as Reciprocal: ONNX Runtime's DivMulFusion turns x * Div(1, s) to x / s)
            div = self.graph.made_by(inverse, "div")
            by = self.node("Reciprocal", [self.name_of(div.invars[1])])[0]  # type: ignore[union-attr]
        else:
            by = self.const(r.astype(np.float32))
        src, s = self.node("Mul", [self.name_of(x), by])[0], self.const(np.float32(1))
        out = self.node("QuantizeLinear", [src, s, zp_name])[0]
        if to == np.int8:
            self.quantized[out] = (src, s, zp_ref)
        return out

    def int_rescale(
        self, v: Any, axes: Sequence[int]
    ) -> tuple[np.ndarray | None, list[C.JaxprEqn], C.JaxprEqn, np.ndarray]:
        """For an int32 sum ``v`` only read as ``float(v - t) * y``, ``t`` constant (or no
        subtraction) and ``y`` constant float32, one or one per column along ``v``'s ``axes``
        (its last; a multi-head projection's heads and head dim): ``t`` (None: none), the
        subtraction and cast, the equation that writes ``* y``, and ``y`` (flattened: one value,
        or one per column). Raises _NoMatch when ``v`` is not read that way."""
        g = self.graph
        shape, chain, term = shaped_aval(v).shape, [], None
        sub = g.sole_user(v, "sub")
        if sub is not None and sub.invars[0] is v:
            term = self.value(sub.invars[1])
            if term is None:
                raise _NoMatch("a zero-point term computed at run time")
            chain.append(sub)
            v = sub.outvars[0]
        cast = g.sole_user(v, "convert_element_type")
        if cast is None or np.dtype(cast.params["new_dtype"]) != np.float32:
            raise _NoMatch("not cast to float32")
        chain.append(cast)
        mul = g.sole_user(cast.outvars[0], "mul")
        y = None
        if mul is not None and shaped_aval(mul.outvars[0]).shape == shape:
            y = self.value(mul.invars[1] if mul.invars[0] is cast.outvars[0] else mul.invars[0])
        if mul is None or y is None or y.dtype != np.float32:
            raise _NoMatch("not scaled by constant float32 scales per output")
        flat = _columns(y, shape, axes)
        if flat is None:
            raise _NoMatch("scales along another axis than the outputs")
        return term, chain, mul, flat

    def rescaled(self, e: C.JaxprEqn) -> tuple[int, C.JaxprEqn, list[C.JaxprEqn], np.ndarray, int]:
        """For an 8-bit dot of constant int8 weights (either operand: Equinox's ``Linear``
        writes ``w @ x``) whose result is only read as ``float(dot - w) * y``, with ``w`` a
        constant zero-point term and ``y`` constant scales per output column: the weights'
        operand index, the equation that writes ``* y``, those between, ``y``, and the
        activation zero point ``c`` for which ``w = c * (column sums of the weights)``, checked
        on the values. Raises _NoMatch when the dot is not read that way."""
        (lc, rc), (bx, _) = e.params["dimension_numbers"]
        values = [self.value(v) for v in e.invars]
        wi = 1 if values[1] is not None and values[1].dtype == np.int8 else 0
        weights, cw = values[wi], (lc, rc)[wi]
        wa = shaped_aval(e.invars[wi])
        fw = [d for d in range(wa.ndim) if d not in cw]
        if bx or weights is None or weights.dtype != np.int8 or not fw:
            raise _NoMatch("not a dot with constant int8 weights and output axes")
        n = math.prod(wa.shape[d] for d in fw)
        axes = _weight_axes(wi, len(shaped_aval(e.outvars[0]).shape), len(fw))
        w, chain, mul, y = self.int_rescale(e.outvars[0], axes)
        cols = np.transpose(weights, [*cw, *fw]).reshape(-1, n).astype(np.int64).sum(0)
        c = 0
        if w is not None:
            per_col = _columns(w, shaped_aval(e.outvars[0]).shape, axes)
            if per_col is None:
                raise _NoMatch("a zero-point term that is not per column")
            terms = np.broadcast_to(per_col, (n,)).astype(np.int64)
            nz = np.flatnonzero(cols)
            c = int(terms[nz[0]] // cols[nz[0]]) if nz.size else 0
            if not np.array_equal(terms, c * cols):
                raise _NoMatch("a zero-point term that is not the weights' column sums")
        return wi, mul, chain, y, c

    def gelu(self, e: C.JaxprEqn) -> tuple[str, Any] | None:
        """``jax.nn.gelu``'s product, as ONNX Runtime's fused kernel and its input: ``Gelu``
        for ``0.5 x * erfc(-x / sqrt 2)``, ``FastGelu`` for ``x * 0.5 (1 + tanh(sqrt(2 / pi)
        (x + 0.044715 x^3)))``; else None."""
        g = self.graph

        def scaled(v: Any, c: float) -> Any:  # x where v is x * c (or c * x), else None
            m = g.made_by(v, "mul")  # (None for v None, as for a value no equation made)
            if m is None:
                return None
            a, b = m.invars
            want = float(np.float32(c))
            return b if self.is_scalar(a, want) else a if self.is_scalar(b, want) else None

        for x, other in (e.invars, e.invars[::-1]):
            erfc = g.made_by(other, "erfc")
            neg = g.made_by(scaled(erfc.invars[0], 0.7071067690849304), "neg") if erfc else None
            if neg is not None and neg.invars[0] is scaled(x, 0.5):
                return "Gelu", neg.invars[0]
            one_plus = g.made_by(scaled(other, 0.5), "add")  # 1 + tanh(...)
            if one_plus is None or not any(self.is_scalar(a, 1.0) for a in one_plus.invars):
                continue
            tanh = next(filter(None, (g.made_by(a, "tanh") for a in one_plus.invars)), None)
            inner = g.made_by(scaled(tanh.invars[0], 0.7978845834732056), "add") if tanh else None
            if inner is None or x not in inner.invars:
                continue
            rest = [a for a in inner.invars if a is not x]
            cube = g.made_by(scaled(rest[0], 0.044714998453855515), "integer_pow") if rest else None
            if cube is not None and cube.params["y"] == 3 and cube.invars[0] is x:
                return "FastGelu", x
        return None

    def carry(self, src: Any, out: Any, times: float, plus: float = 0.0) -> None:
        """``out`` is ``f(src)`` with ``|f(x)| <= times * |x| + plus`` for finite ``x``, finite
        where ``x`` is finite (as far as the bound keeps it finite) and NaN or Inf where it is
        not: ``out`` keeps ``src``'s bound (scaled) and NaN rows."""
        bound = None if C.is_literal(src) or C.is_literal(out) else self.bounded.get(src)
        if bound is None or not bound * times + plus < 1e30:
            return
        if shaped_aval(out).shape != shaped_aval(src).shape:
            return
        self.bounded[out] = bound * times + plus
        self.same_rows[out] = src
        if src in self.rows:
            self.rows[out] = self.rows[src]

    def add_rows(self, e: C.JaxprEqn) -> None:
        """``x + y`` of two bounded values: bounded by the sum, and NaN in a row where either is
        (NaN + anything, Inf + finite, Inf - Inf: not finite)."""
        x, y = e.invars
        out = e.outvars[0]
        if not shaped_aval(x).shape == shaped_aval(y).shape == shaped_aval(out).shape:
            return
        top = self.bounded[x] + self.bounded[y]
        if not top < 1e30:
            return
        self.bounded[out] = top
        if x in self.rows and y in self.rows and self.rows[x][1] == self.rows[y][1]:
            both = self.node("Add", [self.rows[x][0], self.rows[y][0]])[0]
            self.rows[out] = (both, self.rows[x][1])

    def unshaped(self, v: Any) -> Any:
        """``v`` before the broadcasts and reshapes that made it."""
        while (e := self.graph.made_by(v, *_RESHAPES, *_IDENTITY)) is not None:
            v = e.invars[0]
        return v

    def softmax(self, e: C.JaxprEqn) -> Any:
        """``x`` where ``e`` is ``jax.nn.softmax(x)`` over the last axis, ``exp(x - max(x)) /
        sum(...)`` (the max maybe floored at -inf), else None: one ``Softmax`` instead of five
        passes, within float rounding of XLA's, NaN where XLA's is."""
        g = self.graph
        num, den = e.invars
        ex, total = g.made_by(num, "exp"), g.made_by(self.unshaped(den), "reduce_sum")
        sub = None if ex is None else g.made_by(ex.invars[0], "sub")
        if total is None or sub is None or total.invars[0] is not num:
            return None
        x = sub.invars[0]
        last = (shaped_aval(x).ndim - 1,)
        top = self.unshaped(sub.invars[1])
        floor = g.made_by(top, "max")
        if floor is not None:
            i = 0 if self.is_scalar(floor.invars[1], -np.inf) else 1
            top = floor.invars[i] if self.is_scalar(floor.invars[1 - i], -np.inf) else top
        peak = g.made_by(top, "reduce_max")
        if peak is None or peak.invars[0] is not x or tuple(peak.params["axes"]) != last:
            return None
        if (
            tuple(total.params["axes"]) != last
            or shaped_aval(e.outvars[0]).shape != shaped_aval(x).shape
        ):
            return None
        return x

    def mean_of(self, v: Any, n: int) -> Any:
        """``x`` where ``v`` is ``sum(x, last axis) / n`` (or ``* (1 / n)``), broadcast or not."""
        g = self.graph
        e = g.made_by(v, "div", "mul")
        if e is None or not (
            self.is_scalar(e.invars[1], float(n))
            if e.primitive.name == "div"
            else self.is_scalar(e.invars[1], float(np.float32(1 / n)))
        ):
            return None
        total = g.made_by(self.unshaped(e.invars[0]), "reduce_sum")
        if total is None:
            return None
        x = total.invars[0]
        last = (shaped_aval(x).ndim - 1,)
        return x if tuple(total.params["axes"]) == last and shaped_aval(x).shape[-1] == n else None

    def mean(self, e: C.JaxprEqn) -> str | None:
        """``sum(x, last axis) / n`` (or ``* (1 / n)``) of float32 ``x``, the axis kept or not, as
        one ``ReduceMean`` (a layer norm's centering: ``ReduceSum``, ``Reshape`` and ``Div``
        made MiniLM's W8A8+SQ region 2.4% slower in ONNX Runtime at batch 1, 1.8% at 16). None:
        not that pattern."""
        total = self.graph.made_by(self.unshaped(e.invars[0]), "reduce_sum")
        x = None if total is None else total.invars[0]
        xs = () if x is None else shaped_aval(x).shape
        if not xs or not xs[-1] or np.dtype(shaped_aval(x).dtype) != np.float32:
            return None  # (an empty axis: ReduceMean gives 0 where 0 / 0 is NaN)
        if self.mean_of(e.outvars[0], xs[-1]) is not x:
            return None
        out = tuple(shaped_aval(e.outvars[0]).shape)
        keep = out == (*xs[:-1], 1)
        if not keep and out != tuple(xs[:-1]):
            return None
        axes = self.const([len(xs) - 1], np.int64)
        return self.node("ReduceMean", [self.name_of(x), axes], keepdims=int(keep))[0]

    def centered(self, v: Any, n: int) -> tuple[Any, Any] | None:
        """``(x, mean)`` where ``v`` is ``x - mean(x)`` over the last axis (``mean`` unshaped)."""
        sub = self.graph.made_by(v, "sub")
        if sub is None:
            return None
        mean = self.unshaped(sub.invars[1])
        return (sub.invars[0], mean) if self.mean_of(mean, n) is sub.invars[0] else None

    def squared(self, v: Any) -> Any:
        """``x`` where ``v`` is ``x^2`` (``square``, ``integer_pow`` 2 or ``x * x``), else None."""
        sq = self.graph.made_by(v, "square", "integer_pow", "mul")
        if sq is None or (sq.primitive.name == "integer_pow" and sq.params["y"] != 2):
            return None
        if sq.primitive.name == "mul" and sq.invars[0] is not sq.invars[1]:
            return None
        return sq.invars[0]

    def variance(self, v: Any, n: int, here: tuple[Any, Any]) -> bool:
        """Whether ``v`` is the variance over the last axis of ``x`` centered as ``here`` (``(x,
        mean)``): the mean of ``(x - mean)^2`` (the mean maybe computed again, as ``jnp.var``
        does), or Flax's ``E[x^2] - mean^2``; either maybe floored at 0 (Flax, Equinox)."""
        v = self.unshaped(v)
        floor = self.graph.made_by(v, "max")  # (what rounding puts below 0, clamped)
        if floor is not None:
            zero = [self.is_scalar(a, 0.0) for a in floor.invars]
            v = floor.invars[1] if zero[0] else floor.invars[0] if zero[1] else None
        x, mean = here
        again = self.centered(self.squared(self.mean_of(v, n)), n)
        if again is not None and again[0] is x:  # (centered by a mean of the same x)
            return True
        sub = self.graph.made_by(v, "sub")
        return (
            sub is not None
            and self.squared(self.mean_of(sub.invars[0], n)) is x
            and self.squared(sub.invars[1]) is mean
        )

    def layer_norm(self, e: C.JaxprEqn) -> str | None:
        """``(x - mean) * rsqrt(var + eps)`` over the last axis (``var`` the mean of ``(x -
        mean)^2``, or Flax's ``E[x^2] - mean^2`` floored at 0), then ``* scale + bias``
        (constants) if they follow (Flax multiplies the scale into the ``rsqrt`` first), as
        ``LayerNormalization`` of the centered ``x - mean``: its numbers within float rounding
        of XLA's (ONNX Runtime computes the variance as ``E[d^2] - E[d]^2``, which loses nothing
        once ``d`` is centered; Flax's form loses what cancels where ``|mean|`` dwarfs the
        spread, ONNX Runtime's does not), one pass instead of five. None: not that pattern."""
        g = self.graph
        shape = shaped_aval(e.outvars[0]).shape
        if not shape:
            return None
        n = shape[-1]
        for d, r in (e.invars, e.invars[::-1]):
            r, first = self.unshaped(r), None
            if (m := g.made_by(r, "mul")) is not None:  # rsqrt(var + eps) * scale
                for a, b in (m.invars, m.invars[::-1]):
                    v = self.value(b)
                    col = None if v is None or v.dtype != np.float32 else _columns(v, (n,), (0,))
                    if col is not None:
                        r, first = self.unshaped(a), np.broadcast_to(col, (n,))
                        break
            rs = g.made_by(r, "rsqrt")
            plus = None if rs is None else g.made_by(rs.invars[0], "add")
            here = self.centered(d, n)
            if plus is None or here is None or shaped_aval(d).shape != tuple(shape):
                continue
            i = 0 if self.value(plus.invars[1]) is not None else 1  # (var + eps, or eps + var)
            eps = self.value(plus.invars[1 - i])
            if eps is None or eps.size != 1 or not self.variance(plus.invars[i], n, here):
                continue
            out, chain = e.outvars[0], []
            vectors = [] if first is None else [first.astype(np.float32)]
            for op in ("mul", "add")[len(vectors) :]:
                nxt = g.sole_user(out, op)
                other = None if nxt is None else nxt.invars[1 if nxt.invars[0] is out else 0]
                v = None if other is None else self.value(other)
                if nxt is None or v is None or v.dtype != np.float32 or v.size != n:
                    break
                if v.shape[-1] != n or shaped_aval(nxt.outvars[0]).shape != tuple(shape):
                    break
                vectors.append(v.reshape(n))
                chain.append(nxt)
                out = nxt.outvars[0]
            scale = vectors[0] if vectors else np.ones(n, np.float32)
            bias = vectors[1] if len(vectors) > 1 else np.zeros(n, np.float32)
            norm = self.node(
                "LayerNormalization",
                [self.name_of(d), self.const(scale), self.const(bias)],
                axis=-1,
                epsilon=float(eps.reshape(())),
            )[0]
            y = (chain[-1] if chain else e).outvars[0]
            self.norms[y] = (self.name_of(d), scale, bias, float(eps.reshape(())))
            if chain:
                self.done.update({id(q): None for q in chain[:-1]})
                self.done[id(chain[-1])] = (norm, None)
            # (|d / sqrt(mean(d^2) + eps)| <= sqrt(n): finite elements are at most this)
            top = float(np.sqrt(n) * 1.001 * np.abs(scale).max() + np.abs(bias).max())
            self.bounded[y] = top
            x = here[0]
            if x in self.rows and self.bounded.get(x, np.inf) < 1e18:
                self.rows[y] = self.rows[x]  # (a finite row's variance is finite: finite out)
            return norm
        return None

    def scaled_norm(self, e: C.JaxprEqn) -> str | None:
        """A layer norm's output times a constant per element of the last axis, as one more
        ``LayerNormalization`` of the same centered input with the constant in its scale and
        bias: one normalizing pass instead of a multiply (SmoothQuant's factors before a layer's
        quantize, where the normalized value also feeds a residual sum), in tensors of few rows
        (``_SCALED_NORM_MAX_ROWS``). None: not that."""
        shape = shaped_aval(e.outvars[0]).shape
        if not shape or math.prod(shape[:-1]) > _SCALED_NORM_MAX_ROWS:
            return None
        if self.graph.sole_user(e.outvars[0], "round") is not None:
            return None  # (realize's quantize, x * (1 / s): see quantize_linear)
        for i in (0, 1):
            v = e.invars[i]
            norm = None if C.is_literal(v) else self.norms.get(v)
            c = None if norm is None else self.value(e.invars[1 - i])
            if norm is None or c is None or c.dtype != np.float32 or shaped_aval(v).shape != shape:
                continue
            col = _columns(c, shape, (len(shape) - 1,))
            if col is None or not np.all(np.isfinite(col)):
                continue
            d, scale, bias, eps = norm
            col = np.broadcast_to(col, scale.shape)
            with np.errstate(over="ignore"):
                folded = scale * col, bias * col
            if not all(np.all(np.isfinite(f)) for f in folded):
                continue  # (a product past float32's range: the multiply stays)
            out = self.node(
                "LayerNormalization",
                [d, self.const(folded[0]), self.const(folded[1])],
                axis=-1,
                epsilon=eps,
            )[0]
            self.carry(v, e.outvars[0], float(np.abs(col).max()))
            return out
        return None

    def zero_sum(self, x: Any, axes: Sequence[int], shape: Sequence[int]) -> str:
        """``|sum(x * 0)|`` over ``axes``, reshaped to ``shape``: NaN where the row holds NaN
        or Inf, +0 elsewhere (as XLA's sum from +0; ONNX Runtime's gives -0 for a negative row);
        a wide last axis as ``x @ zeros`` (one read, no ``x * 0`` written)."""
        aval = shaped_aval(x)
        wide, large = _NAN_ROW_MATMUL_MIN
        row, row_shape = self.rows.get(x, (None, ()))
        kept = tuple(1 if i in axes else d for i, d in enumerate(aval.shape))
        if row is not None and tuple(row_shape) == kept:  # (already computed)
            return self.reshape(self.node("Abs", [row])[0], shape)
        count = int(np.prod([aval.shape[i] for i in axes], dtype=np.int64))
        src, red = self.name_of(x), list(axes)
        if len(axes) > 1 and tuple(axes) == tuple(range(aval.ndim - len(axes), aval.ndim)):
            # (trailing axes as one: ONNX Runtime took 177 us on [256, 8, 8, 1], 16 on [256, 64])
            lead = list(aval.shape[: aval.ndim - len(axes)])
            src, red = (
                self.node("Reshape", [src, self.const([*lead, -1], np.int64)])[0],
                [len(lead)],
            )
        if x in self.bounded and self.bounded[x] * count < 1e30:
            # (a finite row's sum stays finite: sum(x) * 0 is as good, one pass fewer; and it is
            # the NaN row of x and of what x was scaled from, for later checks)
            total = self.node("ReduceSum", [src, self.const(red, np.int64)], keepdims=1)
            if len(red) == len(axes):  # (x itself reduced: the kept shape)
                self.shape_of[total[0]] = kept
            total = self.node("Mul", [total[0], self.const(0, aval.dtype)])
            self.zero_or_nan.add(total[0])
            named = self.reshape(self.node("Abs", total)[0], kept)
            v = x
            while v is not None and shaped_aval(v).shape == aval.shape:
                self.rows.setdefault(v, (named, kept))
                v = self.same_rows.get(v)
        elif tuple(axes) == (aval.ndim - 1,) and aval.shape[-1] >= wide and aval.size >= large:
            zeros = self.const(np.zeros((aval.shape[-1], 1), aval.dtype))
            total = self.node("MatMul", [src, zeros])
        else:
            times = self.node("Mul", [src, self.const(0, aval.dtype)])
            total = self.node("ReduceSum", [times[0], self.const(red, np.int64)])
        self.zero_or_nan.add(total[0])
        return self.reshape(self.node("Abs", total)[0], shape)

    def magnitude_of(self, v: Any) -> Any:
        """``x`` where ``v`` is ``|x|``, or ``|x|`` with NaN as Inf (realize's NaN-safe form),
        possibly converted to float32; else None."""
        g = self.graph
        cast = g.made_by(v, "convert_element_type")
        v = cast.invars[0] if cast is not None else v
        absolute = g.made_by(v, "abs")
        if absolute is not None:
            return absolute.invars[0]
        sel = g.made_by(v, "select_n")
        if sel is None or len(sel.invars) != 3:
            return None
        isnan, absolute, inf = (
            g.made_by(sel.invars[0], "ne"),
            g.made_by(sel.invars[1], "abs"),
            self.value(sel.invars[2]),
        )
        if isnan is None or absolute is None or inf is None or not np.all(np.isposinf(inf)):
            return None
        x = absolute.invars[0]
        return x if isnan.invars[0] is x and isnan.invars[1] is x else None

    def nan_row(self, e: C.JaxprEqn) -> bool:
        """Whether the value of ``e`` (a ``max |x|``) is only ever multiplied by 0."""
        times_zero = lambda u, v: (
            u.primitive.name == "mul"
            and any(self.is_scalar(b, 0.0) for b in u.invars if b is not v)
        )
        return self.graph.only_read_through(e.outvars[0], _SHAPE_OPS, times_zero)

    def poison(self, a: Any) -> bool:
        """Whether ``a`` is realize's NaN row: ``r * 0`` or ``where(bad, nan, 0)``, so adding it
        leaves a float as it is or makes it NaN (and the order of additions does not matter)."""
        e = self.graph.made_by(a, "mul", "select_n", "jit", "pjit", *_RESHAPES)
        if e is not None and e.primitive.name in _RESHAPES:
            return self.poison(e.invars[0])
        if e is None:
            return False
        if e.primitive.name == "mul":
            return any(self.is_scalar(b, 0.0) for b in e.invars)
        cases = [self.value(b) for b in e.invars[1:]]
        if e.primitive.name != "select_n" and C.call_name(e) != "_where":
            return False
        return all(c is not None and c.size == 1 for c in cases) and {
            "nan" if np.isnan(c) else float(c)  # type: ignore[arg-type]
            for c in cases
        } <= {"nan", 0.0}

    def biased(
        self, mul: C.JaxprEqn, n: int, axes: Sequence[int] | None = None
    ) -> tuple[list[C.JaxprEqn], Any, Any]:
        """After ``float(dot) * y`` (``n`` scales along the output's ``axes``, default its last,
        or one): ``+ bias`` (constant, per column), possibly after ``+`` a NaN row, or the NaN
        row alone. Returns the equations of that, the bias as a vector (None: no bias) and the
        NaN row to add after the fused kernel (None: none)."""
        g = self.graph
        add = g.sole_user(mul.outvars[0], "add")
        if add is None:
            return [], None, None
        out = shaped_aval(mul.outvars[0]).shape
        axes = (len(out) - 1,) if axes is None else axes
        size = math.prod(out[a] for a in axes)

        def vector(add: C.JaxprEqn | None, v: Any) -> Any:  # the constant added to v, if a bias
            if add is None or shaped_aval(add.outvars[0]).shape != out or n not in (1, size):
                return None
            bias = self.value(add.invars[1] if add.invars[0] is v else add.invars[0])
            per_col = (
                None if bias is None or bias.dtype != np.float32 else _columns(bias, out, axes)
            )
            if per_col is None:
                return None
            return np.broadcast_to(per_col, (size,)).astype(np.float32)

        bias = vector(add, mul.outvars[0])
        if bias is not None:
            return [add], bias, None
        other = add.invars[0] if add.invars[1] is mul.outvars[0] else add.invars[1]
        if not self.poison(other) or shaped_aval(add.outvars[0]).shape != out:
            return [], None, None
        nxt = g.sole_user(add.outvars[0], "add")
        bias = vector(nxt, add.outvars[0])
        if nxt is None or bias is None:
            return [add], None, other
        return [add, nxt], bias, other

    def transpose(self, x: str, perm: Sequence[int]) -> str:
        if list(perm) == sorted(perm):
            return x
        if x in self.values:  # (folded: see reshape)
            return self.const(np.transpose(self.values[x], perm))
        return self.node("Transpose", [x], perm=list(perm))[0]

    def shifted_u8(self, x: str, dtype: Any) -> tuple[str, str | None]:
        """int8 codes as uint8 ``codes + 128`` and the zero point 128 that undoes it (exactly),
        or uint8 codes as they are; ONNX Runtime's fast x86 int8 kernels take uint8 activations.
        Codes just cast from float (realize's quantize) are shifted before the cast instead."""
        if np.dtype(dtype) == np.uint8:
            return x, None
        if x in self.u8:
            return self.u8[x], self.const(128, np.uint8)
        if x in self.quantized:  # the same QuantizeLinear with its zero point moved by 128
            src, scale, zp = self.quantized[x]
            if isinstance(zp, np.ndarray):
                zp_u8 = self.const(zp.astype(np.int16) + 128, np.uint8)
            else:
                wide = self.node("Cast", [zp], to=self.onnx.TensorProto.INT16)
                moved = self.node("Add", [wide[0], self.const(128, np.int16)])
                zp_u8 = self.node("Cast", moved, to=self.onnx.TensorProto.UINT8)[0]
            return self.node("QuantizeLinear", [src, scale, zp_u8])[0], self.const(128, np.uint8)
        if x in self.float_codes:  # integer-valued floats in [-128, 127]: + 128 is exact
            src, dt = self.float_codes[x]
            shifted = self.node("Add", [src, self.const(128, dt)])
            return self.node("Cast", shifted, to=self.onnx.TensorProto.UINT8)[0], self.const(
                128, np.uint8
            )
        return self.plus_128(x), self.const(128, np.uint8)

    def weights_u8(self, w: str, dtype: Any) -> tuple[str, str]:
        """The right operand of an 8-bit kernel and its zero point: as it is (zero point 0), or
        int8 shifted into uint8 (zero point 128) where uint8 x int8 kernels saturate (see
        ``_u8s8_exact``)."""
        if np.dtype(dtype) == np.uint8 or _u8s8_exact() or self.seven_bit(w):
            return w, self.const(0, dtype)
        return self.plus_128(w), self.const(128, np.uint8)

    def seven_bit(self, w: str) -> bool:
        """Whether ``w`` is a constant whose codes lie in [-64, 64] (7-bit weights: ONNX Runtime's
        ``reduce_range``): a pair of uint8 x int8 products then sums to at most 2 * 255 * 64 =
        32640, inside int16, so the kernels without VNNI are exact on them and run at their
        full speed (uint8 x uint8 ran a MiniLM-sized layer 1.2x slower on an AVX2 EPYC)."""
        v = self.values.get(w)
        return v is not None and (v.size == 0 or int(np.abs(v.astype(np.int16)).max()) <= 64)

    def plus_128(self, x: str) -> str:
        """int8 values as uint8 ``x + 128`` (through int16: exact)."""
        if x in self.values:  # (a weight: shifted here, so it stays an initializer)
            return self.const((self.values[x].astype(np.int16) + 128).astype(np.uint8))
        wide = self.node("Cast", [x], to=self.onnx.TensorProto.INT16)
        shifted = self.node("Add", [wide[0], self.const(128, np.int16)])
        return self.node("Cast", shifted, to=self.onnx.TensorProto.UINT8)[0]

    def shadow(self, e: C.JaxprEqn, ins: list[str], outs: list[str]) -> None:
        """Write the uint8 twin (``value + 128``) of an int8 result whose inputs have twins,
        where the op commutes with the shift: shape ops, pooling, a max or min with a constant
        (ReLU on codes), a pad with a constant. Twins nothing reads are dropped at the end."""
        name = e.primitive.name
        if np.dtype(shaped_aval(e.outvars[0]).dtype) != np.int8:
            return
        if name in (*_SHIFT_COMMUTING, "reduce_window_max", "max", "min", "pad"):
            for x in ins:  # (a quantize's twin: the same QuantizeLinear, zero point + 128)
                if x in self.quantized and x not in self.u8:
                    self.u8[x] = self.shifted_u8(x, np.int8)[0]
        twins = [self.u8.get(i) for i in ins]
        twin: list[str] | None = None
        if name in _SHIFT_COMMUTING and all(twins):
            twin = self.eqn(e, [t for t in twins if t is not None])
        elif name == "reduce_window_max" and twins[0] is not None:
            twin = self.pool("MaxPool", e, [twins[0]])
        elif name in ("max", "min", "pad"):
            i = 0 if twins[0] is not None else 1
            c = self.value(e.invars[1 - i])
            if twins[i] is not None and c is not None and c.size == 1 and (name != "pad" or i == 0):
                shifted = self.const(int(c.reshape(())) + 128, np.uint8)
                if name == "pad":
                    twin = self.eqn(e, [twins[0], shifted])  # type: ignore[list-item]
                else:
                    twin = self.node(_BINARY[name], [twins[i], shifted])  # type: ignore[list-item]
        if twin is not None:
            self.u8[outs[0]] = twin[0]

    def expand(self, x: str, shape: Sequence[int]) -> str:
        return self.node("Expand", [x, self.const(list(shape), np.int64)])[0]

    def nonfinite(self, v: Any, axes: Sequence[int] = ()) -> str:
        """Whether a value of finite_like holds NaN or Inf, over ``axes`` (any), not expanded."""
        row = self.finite_like[v]
        if row is None:
            return self.const(False, np.bool_)
        shape = shaped_aval(row).shape
        flat = [shape[i] for i in range(len(shape)) if i not in axes]
        if self.fuse and all(shape[i] == 1 for i in axes):  # (one row already: no reduction)
            named = self.reshape(self.name_of(row), flat)
            bad = self.node("IsNaN", [named])[0]
            self.isnan_of[bad] = named
            return bad
        summed = self.zero_sum(row, axes, flat)
        bad = self.node("IsNaN", [summed])[0]
        self.isnan_of[bad] = summed
        return bad

    def requantizing(self, z: Any) -> tuple[list[C.JaxprEqn], C.JaxprEqn, float, int]:
        """For a float value read only by realize's quantize to int8 codes (see quantize_form)
        and by ``is_finite``: the quantize's equations, its last one (the int8 cast), and its
        constant scale and zero point. Raises _NoMatch when ``z`` is read otherwise."""
        g = self.graph
        users = g.readers.get(z, [])
        if g.count.get(z) != sum(u.invars.count(z) for u in users):
            raise _NoMatch("an output of the region")
        muls = [u for u in users if u.primitive.name != "is_finite"]
        if len(muls) != 1 or muls[0].primitive.name != "mul" or muls[0].invars[0] is not z:
            raise _NoMatch("not read by one quantize")
        chain, e = [muls[0]], muls[0]
        while not (
            e.primitive.name == "convert_element_type"
            and np.dtype(e.params["new_dtype"]) == np.int8
        ):
            nxt = g.sole_user(e.outvars[0], "round", "add", "jit", "pjit", "clamp", "max", "min",
                              "convert_element_type")  # fmt: skip
            if nxt is None or len(chain) > 7:
                raise _NoMatch("not a quantize to int8 codes")
            chain.append(nxt)
            e = nxt
        form = self.quantize_form(e)
        r = None if form is None else self.inverse_value(form[1])
        zp = np.zeros(()) if form is None or form[2] is None else self.value(form[2])
        if form is None or form[0] is not z or r is None or zp is None:
            raise _NoMatch("not a quantize with constant scale and zero point")
        if float(zp) != round(float(zp)) or not 0 <= float(zp) + 128 <= 255 or float(r) <= 0:
            raise _NoMatch("a zero point off the uint8 range once shifted")
        return chain, e, 1 / float(r), int(zp)

    def channel_affine(self, v: Any, n: int) -> tuple[list[C.JaxprEqn], np.ndarray, np.ndarray]:
        """The per-channel affine map ``v * gain + shift`` (last axis, ``n`` channels) that
        equations adding, subtracting and multiplying constants compute from ``v`` (an inference
        BatchNorm, ``(v - mean) * k + beta``, once its constants are folded): those equations,
        ``gain`` and ``shift`` (float64; none: ones and zeros)."""
        g = self.graph
        out = shaped_aval(v).shape
        eqns: list[C.JaxprEqn] = []
        gain, shift = np.ones(n), np.zeros(n)
        while (e := g.sole_user(v, "add", "sub", "mul")) is not None:
            i = 0 if e.invars[0] is v else 1
            c = self.value(e.invars[1 - i])
            col = None if c is None or c.dtype != np.float32 else _columns(c, out, (len(out) - 1,))
            if shaped_aval(e.outvars[0]).shape != out or col is None:
                break
            col = np.broadcast_to(col.astype(np.float64), (n,))
            if not np.all(np.isfinite(col)):
                break
            if e.primitive.name == "mul":
                gain, shift = gain * col, shift * col
            elif e.primitive.name == "add" or i == 0:  # (v + c, v - c)
                shift = shift + col if e.primitive.name == "add" else shift - col
            else:  # c - v
                gain, shift = -gain, col - shift
            eqns.append(e)
            v = e.outvars[0]
        return eqns, gain, shift

    def requantized_conv(self, e: C.JaxprEqn) -> list[str]:
        """An int8 convolution whose result realize only rescales and biases to float and
        quantizes to the next layer's int8 codes, ``q(float(conv(x, w) - t) * y + b)``, as one
        ``QLinearConv`` on uint8 codes (ONNX Runtime's fast x86 path; its NHWC kernels, not
        ``ConvInteger``'s loop). The integer sums are the same (padding holds the zero point, so
        it adds 0, as realize's term ``t`` makes it); its requantize rounds ``(acc + round(b /
        y)) * (y / s)`` in float where realize rounds ``(acc * y + b) / s``, which differ by
        less than ``y / s / 2 + 1e-4`` steps before rounding: with ``y / s <= 1`` (checked), a
        code is realize's or one step from it. Channels-last outputs; raises _NoMatch else."""
        g = self.graph
        p = e.params
        dn = p["dimension_numbers"]
        w = self.value(e.invars[1])
        out = shaped_aval(e.outvars[0])
        rank = out.ndim
        if (
            w is None
            or w.dtype != np.int8
            or any(d != 1 for d in p["lhs_dilation"])
            or p["batch_group_count"] != 1
            or dn.out_spec[1] != rank - 1
        ):
            raise _NoMatch("not a channels-last int8 convolution with constant weights")
        n = out.shape[-1]
        term, chain, mul, y = self.int_rescale(e.outvars[0], (rank - 1,))
        if term is not None and (term.ndim != rank or term.shape[0] != 1):
            raise _NoMatch("a zero-point term per sample")
        scale = np.broadcast_to(y.reshape(-1), (n,)).astype(np.float64)
        adds, bias, row = self.biased(mul, y.size)
        last = adds[-1] if adds else mul
        affine, gain, shift = self.channel_affine(last.outvars[0], n)  # (a BatchNorm)
        last = affine[-1] if affine else last
        scale, bias = scale * gain, (0 if bias is None else bias) * gain + shift
        quantize, codes, s, zp = self.requantizing(last.outvars[0])
        # the input: codes, maybe padded with a constant by realize (with the zero point)
        x, fill = e.invars[0], None
        pads = [list(lh) for lh in p["padding"]]
        pad = g.made_by(x, "pad")
        if pad is not None and (fill := self.value(pad.invars[1])) is not None:
            cfg = pad.params["padding_config"]
            kept = (dn.lhs_spec[0], dn.lhs_spec[1])
            if any(i or lo < 0 or hi < 0 for lo, hi, i in cfg) or any(
                cfg[d][:2] != (0, 0) for d in kept
            ):
                raise _NoMatch("a pad other than spatial")
            for pd, d in zip(pads, dn.lhs_spec[2:], strict=True):
                pd[0], pd[1] = pd[0] + cfg[d][0], pd[1] + cfg[d][1]
            x = pad.invars[0]
        # realize's sums minus QLinearConv's (padding = zero point c) must be the term t
        w_oi = np.transpose(w, dn.rhs_spec).astype(np.int64)  # [O, I / groups, kernel...]
        c = int(fill.reshape(())) if fill is not None else 0
        if fill is None and term is not None:  # c from the term, where a window sum is not 0
            sums = self.padding_term(e, x, None, 1)
            nz = np.flatnonzero(sums)
            c = (
                int(np.broadcast_to(term, sums.shape).reshape(-1)[nz[0]] // sums.reshape(-1)[nz[0]])
                if nz.size
                else 0
            )
        if not 0 <= c + 128 <= 255:
            raise _NoMatch("an activation zero point off the uint8 range once shifted")
        want = self.padding_term(e, x, fill, c)
        have = np.zeros((), np.int64) if term is None else term.astype(np.int64)
        if not np.array_equal(np.broadcast_to(have, want.shape), want):
            raise _NoMatch("a zero-point term that is not the zero point's window sums")
        b = bias.astype(np.float64)
        qbias = np.round(b / scale)
        steps = np.abs(w_oi).reshape(n, -1).sum(1) * 255
        if (
            np.any(scale <= 0)
            or np.any(scale / s > 1)
            or np.any(np.abs(qbias) + steps >= 2**31)
            or not np.all(steps * scale + np.abs(b) < 1e38)  # (so the float result is finite)
        ):
            raise _NoMatch("scales whose requantize could round more than one step apart")
        xu8 = self.shifted_u8(self.name_of(x), np.int8)[0]
        w8 = w_oi.astype(np.int8)
        short = _QLINEAR_CONV_MIN_CHANNELS - w8.shape[1]
        if p["feature_group_count"] == 1 and short > 0:  # (zero-point channels x zero weights)
            # (a Concat with a constant: ONNX Runtime's Pad took 0.2 ms on 256 x 8 x 8 bytes)
            shape = list(shaped_aval(x).shape)
            shape[dn.lhs_spec[1]] = short
            fill_in = self.const(np.full(shape, c + 128, np.uint8))
            xu8 = self.node("Concat", [xu8, fill_in], axis=int(dn.lhs_spec[1]))[0]
            w8 = np.pad(w8, [(0, 0), (0, short), *[(0, 0)] * (w8.ndim - 2)])
        w_zp = np.zeros(n, np.int8)
        if not _u8s8_exact():  # (shifted after the zero channels are padded in)
            w8, w_zp = (w8.astype(np.int16) + 128).astype(np.uint8), np.full(n, 128, np.uint8)
        xu8 = self.transpose(xu8, dn.lhs_spec)
        ins = [
            xu8,
            self.const(1.0, np.float32),
            self.const(c + 128, np.uint8),
            self.const(w8),
            self.const(scale.astype(np.float32)),
            self.const(w_zp),
            self.const(s, np.float32),
            self.const(zp + 128, np.uint8),
            self.const(qbias.astype(np.int32)),
        ]
        attrs: dict[str, Any] = {
            "strides": list(p["window_strides"]),
            "dilations": list(p["rhs_dilation"]),
            "pads": [lo for lo, _ in pads] + [hi for _, hi in pads],
            "group": int(p["feature_group_count"]),
        }
        y8 = self.node("QLinearConv", ins, **attrs)[0]
        twin = self.transpose(y8, [int(d) for d in np.argsort(dn.out_spec)])
        wide = self.node("Cast", [twin], to=self.onnx.TensorProto.INT16)
        moved = self.node("Sub", [wide[0], self.const(128, np.int16)])
        codes_i8 = self.node("Cast", moved, to=self.onnx.TensorProto.INT8)[0]
        self.u8[codes_i8] = twin
        self.done.update({id(q): None for q in [*chain, mul, *adds, *affine, *quantize]})
        self.done[id(codes)] = (codes_i8, None)
        if any(u.primitive.name == "is_finite" for u in g.readers[last.outvars[0]]):
            # (read only for its NaN rows: it shares the row's, its float part being bounded)
            self.finite_like[last.outvars[0]] = row
            self.done[id(last)] = (self.const(0.0, np.float32), row)
        return [twin]  # (the convolution's own int32 result is never read)

    def padding_term(self, e: C.JaxprEqn, x: Any, fill: Any, c: int) -> np.ndarray:
        """What realize subtracts from an int8 convolution of ``x`` (padded with ``fill`` first,
        if not None) so that each window sums ``(x - c) w`` over ``x``'s own positions: ``c``
        times the weights over each window's real positions, plus ``fill`` times them over the
        positions the pad added; shaped like one sample of the output."""
        import jax

        p = e.params
        dn = p["dimension_numbers"]
        shape = list(shaped_aval(x).shape)
        shape[dn.lhs_spec[0]] = 1
        mask = np.full(shape, c, np.int32)
        pad = self.graph.made_by(e.invars[0], "pad")
        w = np.asarray(self.value(e.invars[1]), np.int32)
        # (the exporter may run while jit traces; on the CPU: a GPU has no int32 convolution)
        with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
            if fill is not None and pad is not None:
                cfg = [(lo, hi, 0) for lo, hi, _ in pad.params["padding_config"]]
                mask = np.asarray(jax.lax.pad(mask, np.int32(fill.reshape(())), cfg))
            lhs, rhs = jax.numpy.asarray(mask), jax.numpy.asarray(w)
            term = jax.lax.conv_general_dilated(
                lhs, rhs, p["window_strides"], p["padding"], None, p["rhs_dilation"], dn,
                p["feature_group_count"], 1, None, preferred_element_type=np.int32,
            )  # fmt: skip
            return np.asarray(term, np.int64)

    def conv(self, e: C.JaxprEqn, ins: list[str]) -> list[str]:
        """``conv_general_dilated`` as ``Conv`` (float) or ``ConvInteger`` (8-bit), in ONNX's
        channels-first layout (transposes around it where the equation's layout differs)."""
        p = e.params
        dn = p["dimension_numbers"]
        x_dtype, w_dtype = (np.dtype(shaped_aval(v).dtype) for v in e.invars)
        if x_dtype == np.int8 and not self.exact:
            try:
                return self.requantized_conv(e)
            except _NoMatch:
                pass
        if x_dtype in _INT8 and p["feature_group_count"] == 1:
            return self.int_conv_as_matmul(e, ins)
        x, zp = self.shifted_u8(ins[0], x_dtype) if x_dtype in _INT8 else (ins[0], None)
        x = self.transpose(x, dn.lhs_spec)
        w = self.transpose(ins[1], dn.rhs_spec)
        attrs: dict[str, Any] = {
            "strides": list(p["window_strides"]),
            "dilations": list(p["rhs_dilation"]),
            "pads": [lo for lo, _ in p["padding"]] + [hi for _, hi in p["padding"]],
            "group": int(p["feature_group_count"]),
        }
        if x_dtype in _INT8:
            # (padded positions hold the zero point: they add (zp - zp) * w = 0, as 0 * w in XLA)
            w, w_zp = self.weights_u8(w, w_dtype)
            y = self.node("ConvInteger", [x, w, zp or self.const(0, np.uint8), w_zp], **attrs)[0]
        else:
            y = self.node("Conv", [x, w], **attrs)[0]
        want = np.dtype(shaped_aval(e.outvars[0]).dtype)
        if want != (np.dtype(np.int32) if x_dtype in _INT8 else x_dtype):
            y = self.node("Cast", [y], to=self.helper.np_dtype_to_tensor_dtype(want))[0]
        return [self.transpose(y, [int(d) for d in np.argsort(dn.out_spec)])]

    def int_conv_as_matmul(self, e: C.JaxprEqn, ins: list[str]) -> list[str]:
        """An 8-bit convolution as one ``MatMulInteger``: the padded channels-last input's
        strided slices, one per kernel position, concatenated along the channels (im2col) times
        the kernel as a ``[positions x channels, out]`` matrix. ONNX Runtime's ``ConvInteger``
        is several times slower than its integer GEMM on x86."""
        p = e.params
        dn = p["dimension_numbers"]
        nsp = len(dn.lhs_spec) - 2
        xa, wa = shaped_aval(e.invars[0]), shaped_aval(e.invars[1])
        x, zp = self.shifted_u8(ins[0], xa.dtype)
        x = self.transpose(x, [dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1]])
        w = self.transpose(ins[1], [*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0]])
        n, c = xa.shape[dn.lhs_spec[0]], xa.shape[dn.lhs_spec[1]]
        kernel = [wa.shape[d] for d in dn.rhs_spec[2:]]
        out_aval = shaped_aval(e.outvars[0])
        out_sp = [out_aval.shape[d] for d in dn.out_spec[2:]]
        o = wa.shape[dn.rhs_spec[0]]
        fill = zp if zp is not None else self.const(0, np.uint8)  # (adds (zp - zp) * w = 0)
        lo, hi = [lo for lo, _ in p["padding"]], [hi for _, hi in p["padding"]]
        x = self.node("Pad", [x, self.const([0, *lo, 0, 0, *hi, 0], np.int64), fill])[0]
        axes = self.const(list(range(1, nsp + 1)), np.int64)
        steps = self.const(list(p["window_strides"]), np.int64)
        cols = []
        for offset in itertools.product(*(range(k) for k in kernel)):
            first = [i * d for i, d in zip(offset, p["rhs_dilation"], strict=True)]
            spans = zip(first, out_sp, p["window_strides"], strict=True)
            ends = [f + (m - 1) * s + 1 for f, m, s in spans]
            args = [x, self.const(first, np.int64), self.const(ends, np.int64), axes, steps]
            cols.append(self.node("Slice", args)[0])
        k = int(np.prod(kernel, dtype=np.int64)) * c
        col = self.node("Concat", cols, axis=-1)[0] if len(cols) > 1 else cols[0]
        col = self.node("Reshape", [col, self.const([-1, k], np.int64)])[0]
        w, w_zp = self.weights_u8(self.reshape(w, [k, o]), wa.dtype)
        y = self.node("MatMulInteger", [col, w, zp or self.const(0, np.uint8), w_zp])[0]
        y = self.node("Reshape", [y, self.const([n, *out_sp, o], np.int64)])[0]
        if np.dtype(out_aval.dtype) != np.int32:
            y = self.node("Cast", [y], to=self.helper.np_dtype_to_tensor_dtype(out_aval.dtype))[0]
        # y is [N, spatial..., O]: to the equation's output layout
        perm = [0] * (nsp + 2)
        perm[dn.out_spec[0]], perm[dn.out_spec[1]] = 0, nsp + 1
        for i, d in enumerate(dn.out_spec[2:]):
            perm[d] = 1 + i
        return [self.transpose(y, perm)]

    def pool(self, op: str, e: C.JaxprEqn, ins: list[str], **attrs: Any) -> list[str]:
        """A ``reduce_window_*`` as ONNX pooling ``op``: the unpooled axes go first, as N and C
        (the last one is C; the others, merged, N: Equinox's pooling under ``vmap`` keeps three),
        the pooled ones after them."""
        p = e.params
        pooled = _pooled_axes(p)
        kept = [i for i in range(len(p["window_dimensions"])) if i not in pooled]
        perm = kept + pooled
        x = self.transpose(ins[0], perm)
        shape = [shaped_aval(e.invars[0]).shape[i] for i in perm]
        if len(kept) != 2:
            nc = [math.prod(shape[: len(kept) - 1]), shape[len(kept) - 1]]
            x = self.reshape(x, nc + shape[len(kept) :])
        y = self.node(
            op,
            [x],
            kernel_shape=[p["window_dimensions"][i] for i in pooled],
            strides=[p["window_strides"][i] for i in pooled],
            pads=[p["padding"][i][0] for i in pooled] + [p["padding"][i][1] for i in pooled],
            **attrs,
        )[0]
        if len(kept) != 2:
            y = self.reshape(y, [shaped_aval(e.outvars[0]).shape[i] for i in perm])
        return [self.transpose(y, [int(d) for d in np.argsort(perm)])]

    def fused_dot(self, e: C.JaxprEqn, ins: list[str]) -> list[str] | None:
        """An 8-bit dot that is only rescaled (see :meth:`rescaled`) as one
        ``MatMulIntegerToFloat`` of the activations ``[m, k]`` (shifted into uint8) and the
        weights ``[k, n]``: ``float(dot - w) * y`` is ``(x - a_zp) w * (1 * y)``, the same floats.
        Weights on the left (``w @ x``) give the product transposed, transposed back. None: not
        that pattern."""
        try:
            wi, mul, chain, scales, c = self.rescaled(e)
        except _NoMatch:
            return None
        ai = 1 - wi
        contract = e.params["dimension_numbers"][0]
        aa, wa = shaped_aval(e.invars[ai]), shaped_aval(e.invars[wi])
        ca, cw = contract[ai], contract[wi]
        fa = [d for d in range(aa.ndim) if d not in ca]
        fw = [d for d in range(wa.ndim) if d not in cw]
        a_free, w_free = [aa.shape[d] for d in fa], [wa.shape[d] for d in fw]
        m, k, n = math.prod(a_free), math.prod(aa.shape[d] for d in ca), math.prod(w_free)
        a_zp = c + (0 if np.dtype(aa.dtype) == np.uint8 else 128)
        if not 0 <= a_zp <= 255:
            return None
        x, _ = self.shifted_u8(ins[ai], aa.dtype)
        # ([..., k] x [k, n], as a dense layer reads its input: MatMul broadcasts, no reshapes)
        flat = wi == 1 and tuple(ca) == (aa.ndim - 1,) and len(fw) == 1 and aa.ndim > 2
        if not flat:
            x = self.reshape(self.transpose(x, [*fa, *ca]), [m, k])
        y = self.reshape(self.transpose(ins[wi], [*cw, *fw]), [k, n])
        yw, y_zp = self.weights_u8(y, wa.dtype)
        ins_ = [x, yw, self.const(1.0, np.float32)]
        ins_ += [self.const(scales.reshape(-1 if scales.size > 1 else ()))]
        ins_ += [self.const(a_zp, np.uint8), y_zp]
        out_rank = len(fa) + len(fw)
        after, bias, poison = self.biased(mul, scales.size, _weight_axes(wi, out_rank, len(fw)))
        chain = [*chain, mul, *after]
        last = chain.pop()
        if bias is not None:
            ins_ += [self.const(bias)]
        fused = self.node("MatMulIntegerToFloat", ins_, domain="com.microsoft")
        self.contrib = True
        shape = list(shaped_aval(mul.outvars[0]).shape)
        out = fused[0]
        if wi == 0:  # ([a free..., w free...] -> the dot's [w free..., a free...])
            out = self.reshape(out, [*a_free, *w_free])
            perm = [*range(len(fa), out_rank), *range(len(fa))]
            out = self.transpose(out, perm)
        elif not flat or shape != [*aa.shape[:-1], n]:
            out = self.reshape(out, shape)
        self.done.update({id(q): None for q in chain})
        self.done[id(last)] = (out, poison)
        weights = self.values.get(y)
        if weights is not None:  # (|x - zp| <= 255 for uint8 codes)
            col = np.abs(weights.reshape(k, n).astype(np.float64)).sum(0) * 255
            top = float((col * np.abs(scales.reshape(-1))).max())
            top += 0.0 if bias is None else float(np.abs(bias).max())
            if top < 1e30:  # (its NaN rows: where run() adds the late poison)
                self.bounded[last.outvars[0]] = top
        return fused

    def dot_general(self, e: C.JaxprEqn, ins: list[str]) -> list[str]:
        """``dot_general`` as ``MatMul`` (float) or ``MatMulInteger`` (8-bit, the left operand
        shifted into uint8) on ``[rows, k] x [k, cols]`` (with a leading batch axis where the dot
        has batch axes), transposes and reshapes around it: ONNX Runtime's GEMM kernels and its
        own quantization tools know ``MatMul``, not ``Einsum``."""
        (cx, cy), (bx, by) = e.params["dimension_numbers"]
        xa, ya = shaped_aval(e.invars[0]), shaped_aval(e.invars[1])
        fx = [d for d in range(xa.ndim) if d not in cx and d not in bx]
        fy = [d for d in range(ya.ndim) if d not in cy and d not in by]
        size = lambda a, dims: int(np.prod([a.shape[d] for d in dims], dtype=np.int64))
        b, m, k, n = size(xa, bx), size(xa, fx), size(xa, cx), size(ya, fy)
        lead = [b] if bx else []
        integer = np.dtype(xa.dtype) in _INT8
        if integer and self.fuse and (fused := self.fused_dot(e, ins)) is not None:
            return fused  # (the dot's own int32 result is never read)
        x, zp = self.shifted_u8(ins[0], xa.dtype) if integer else (ins[0], None)
        # ([..., k] x [k, n], as a dense layer reads its input: MatMul broadcasts, no reshapes)
        flat = not bx and tuple(cx) == (xa.ndim - 1,) and len(fy) == 1 and xa.ndim > 2
        # ([batch..., m, k] x [batch..., k, n], as attention's einsums read: MatMul batches over
        # leading axes, and ONNX Runtime fuses a transpose of the last two into the product)
        leading = lambda dims: list(dims) == list(range(len(dims)))
        batched = bool(bx) and leading(bx) and leading(by) and len(fx) == len(cx) == len(fy) == 1
        if batched:
            x = self.transpose(x, [*bx, *fx, *cx])
            y = self.transpose(ins[1], [*by, *cy, *fy])
        else:
            if not flat:
                x = self.reshape(self.transpose(x, [*bx, *fx, *cx]), [*lead, m, k])
            y = self.reshape(self.transpose(ins[1], [*by, *cy, *fy]), [*lead, k, n])
        if integer:
            y, y_zp = self.weights_u8(y, ya.dtype)
            out = self.node("MatMulInteger", [x, y, zp or self.const(0, np.uint8), y_zp])
        else:
            out = self.node("MatMul", [x, y])
        out_aval = shaped_aval(e.outvars[0])
        if not (flat or batched):
            out = self.node("Reshape", [out[0], self.const(list(out_aval.shape), np.int64)])
        computed = np.dtype(np.int32) if integer else np.dtype(xa.dtype)
        if np.dtype(out_aval.dtype) != computed:
            out = self.node("Cast", out, to=self.helper.np_dtype_to_tensor_dtype(out_aval.dtype))
        return out


def export_onnx(region: Program, *, onnxruntime_ops: bool = True, exact: bool = False) -> Any:
    """Export a region (a Program over flat arrays) to an ``onnx.ModelProto``.

    With ``onnxruntime_ops`` (the default), an 8-bit dot whose result is only rescaled to float
    (realize's ``float(dot - zero-point term) * scales``) becomes one ONNX Runtime
    ``com.microsoft.MatMulIntegerToFloat`` (the same floats, one kernel instead of four; a bias
    fused in rounds apart by an ulp or two of the product: XLA:CPU adds it in one FMA);
    ``onnxruntime_ops=False`` keeps to the standard ONNX domain, for other runtimes.

    An 8-bit convolution whose result realize only requantizes to the next layer's int8 codes
    becomes one ``QLinearConv``, whose requantize rounds in float: each such code is realize's
    or one step from it. ``exact=True`` keeps every integer equal to realize's (``ConvInteger``
    arithmetic and realize's own float rescale and rounding; slower).
    """
    if not isinstance(region, Program):
        hint = " (call it: region.program())" if callable(region) else ""
        raise TypeError(
            f"export_onnx: expects a jaxq.Program, such as a region's, "
            f"jaxq.partition.regions(p)[i].program(); got {type(region).__name__}{hint}"
        )
    try:
        import onnx
    except ImportError as e:
        raise BackendError(
            "export_onnx needs the 'onnx' package: pip install onnx onnxruntime (or jaxq[onnx])"
        ) from e
    closed = region.jaxpr
    bad = unsupported_onnx_primitives(closed.jaxpr)
    if bad:
        raise BackendError(
            f"the ONNX exporter cannot export region {region.name!r}: no rule for {sorted(bad)}"
        )
    ex = _Exporter(onnx, fuse=onnxruntime_ops, exact=exact)
    names = [f"in{i}" for i in range(len(closed.jaxpr.invars))]
    outs = ex.run(closed.jaxpr, closed.consts, names)
    h = onnx.helper
    inputs = [
        h.make_tensor_value_info(n, h.np_dtype_to_tensor_dtype(np.dtype(a.dtype)), list(a.shape))
        for n, a in zip(names, closed.in_avals, strict=True)
    ]
    outputs = []
    for k, (o, a) in enumerate(zip(outs, closed.out_avals, strict=True)):
        name = f"out{k}"
        ex.nodes.append(h.make_node("Identity", [o], [name]))
        dt = h.np_dtype_to_tensor_dtype(np.dtype(a.dtype))
        outputs.append(h.make_tensor_value_info(name, dt, list(a.shape)))
    live, nodes = {o.name for o in outputs}, []
    for node in reversed(ex.nodes):  # (what a pattern rule replaced is read by nothing: gone)
        if any(o in live for o in node.output):
            nodes.append(node)
            live.update(node.input)
    inits = [t for t in ex.inits if t.name in live]  # (weights whose layout was folded: gone)
    graph = h.make_graph(nodes[::-1], region.name, inputs, outputs, inits)
    opsets = [h.make_opsetid("", OPSET)]
    if ex.contrib:
        opsets.append(h.make_opsetid("com.microsoft", 1))
    model = h.make_model(graph, opset_imports=opsets, producer_name="jaxq", ir_version=9)
    onnx.checker.check_model(model)
    return model


def _weight_axes(wi: int, out_rank: int, w_free: int) -> range:
    """The axes of a dot's output (``[lhs free..., rhs free...]``, no batch axes) that its
    weights, operand ``wi`` with ``w_free`` free axes, own."""
    return range(out_rank - w_free, out_rank) if wi == 1 else range(w_free)


def _plus_zero(c: np.ndarray) -> bool:
    """Whether every element of ``c`` is +0."""
    return not np.any(c) and not np.any(np.signbit(c))


@functools.cache
def _fused_kernels_run() -> bool:
    """Whether the installed ONNX Runtime runs ``MatMulIntegerToFloat`` with a scale per column
    and a bias as the exporter writes it, and gets the same floats (older releases took one
    scale): checked once per process on a 2 x 3 x 2 product."""
    import onnx
    import onnxruntime as ort

    h, t = onnx.helper, onnx.TensorProto
    a = np.array([[0, 255, 7], [130, 1, 128]], np.uint8)
    b = np.array([[1, -2], [3, 127], [-128, 5]], np.int8)
    scale, bias = np.array([0.5, 0.25], np.float32), np.array([1.0, -2.0], np.float32)
    values = {"b": b, "one": np.float32(1), "s": scale, "zp": np.uint8(128), "c": bias}
    inits = [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in values.items()]
    node = h.make_node(
        "MatMulIntegerToFloat", ["a", "b", "one", "s", "zp", "", "c"], ["y"], domain="com.microsoft"
    )
    graph = h.make_graph(
        [node], "probe", [h.make_tensor_value_info("a", t.UINT8, [2, 3])],
        [h.make_tensor_value_info("y", t.FLOAT, [2, 2])], inits,
    )  # fmt: skip
    opsets = [h.make_opsetid("", OPSET), h.make_opsetid("com.microsoft", 1)]
    model = h.make_model(graph, opset_imports=opsets, ir_version=9)
    want = ((a.astype(np.int32) - 128) @ b.astype(np.int32)).astype(np.float32) * scale + bias
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return bool(np.array_equal(sess.run(None, {"a": a})[0], want))
    except Exception:  # (any failure: the standard ops instead)
        return False


class OrtRegion:
    """A region running in ONNX Runtime: call it on the region's operands, under ``jit`` or not.
    The ``"onnxruntime"`` backend makes one from :func:`export_onnx`'s model; a custom codegen
    can give any ONNX model with the region's inputs and outputs (one from another quantizer)::

        register_backend("ort_dynamic", lambda region: OrtRegion(region, my_model(region)))

    On XLA:CPU, XLA calls the session on its own buffers through an FFI call where jaxq's small
    C++ crossing builds, else through ``jax.pure_callback`` (see above). On other platforms (a
    GPU) the operands cross to the host through ``jax.pure_callback``: the FFI handler reads host
    memory, so it is registered for XLA:CPU only, and ``lax.platform_dependent`` picks the
    crossing when the program is lowered for its device (an eager call: by its arrays' device)."""

    def __init__(self, region: Program, model: Any) -> None:
        self.model = model
        """The exported ``onnx.ModelProto``."""
        self._data = model.SerializeToString()
        self._inputs = [i.name for i in model.graph.input]
        self._result = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in region.jaxpr.out_avals]
        lib = _ort_ffi.library()
        self.crossing = "ffi" if lib is not None else "pure_callback"
        """How XLA:CPU reaches ONNX Runtime: ``"ffi"`` or ``"pure_callback"`` (other platforms
        always cross through ``jax.pure_callback``)."""
        self._count = [0]
        if lib is not None:
            outputs = [o.name for o in model.graph.output]
            self._native = _ort_ffi.Session(lib, region.name, self._data, self._inputs, outputs)
        self._host = callback_runner(region, self._run_host)

    @functools.cached_property
    def session(self) -> Any:
        """An ``onnxruntime.InferenceSession`` on the model (the pure_callback crossing runs it;
        opened on first use otherwise)."""
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        # one thread per core, and idle threads sleep: spinning ORT threads next to XLA's made
        # the XLA code beside them 3x slower on 2 cores (the FFI crossing opens its session
        # with the same options)
        opts.intra_op_num_threads = os.cpu_count() or 1
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        return ort.InferenceSession(self._data, opts, providers=["CPUExecutionProvider"])

    def calls(self) -> int:
        """How many times the region has run."""
        return self._count[0] + (self._native.calls if self.crossing == "ffi" else 0)

    def _run_host(self, *args: Any) -> list[np.ndarray]:
        feeds = {n: np.asarray(a) for n, a in zip(self._inputs, args, strict=True)}
        outs = self.session.run(None, feeds)
        self._count[0] += 1
        return outs

    def __call__(self, *args: Any) -> Sequence[Any]:
        if self.crossing != "ffi":
            return self._host(*args)
        native = lambda *a: list(self._native(self._result, *a))
        host = lambda *a: list(self._host(*a))
        if any(C.is_tracer(a) for a in args):  # (the platform is known when lowering)
            return lax.platform_dependent(*args, cpu=native, default=host)
        # an eager call (no cond to dispatch: it cost 40 us a call): where its arrays are
        on_cpu = all(
            d.platform == "cpu"
            for a in args
            for d in (a.devices() if isinstance(a, jax.Array) else [jax.devices()[0]])
        )
        return native(*args) if on_cpu else host(*args)


def onnx_codegen(region: Program, *, exact: bool = False) -> OrtRegion:
    """Export the region (``exact``: see export_onnx) and open an ONNX Runtime session for it
    (CPU execution provider)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as e:
        raise BackendError(
            "the onnxruntime backend needs the 'onnxruntime' package: pip install onnxruntime "
            "(or jaxq[onnx])"
        ) from e
    return OrtRegion(region, export_onnx(region, onnxruntime_ops=_fused_kernels_run(), exact=exact))


register_backend("onnxruntime", onnx_codegen)
