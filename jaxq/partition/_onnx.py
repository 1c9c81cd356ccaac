"""The ``"onnxruntime"`` backend: export a region to ONNX and run it in ONNX Runtime.

A small exporter covers the ops regions usually hold (elementwise arithmetic and activations,
``dot_general`` as ``MatMul``, convolutions, max pooling, pads, broadcasts, reshapes, transposes,
slices, concatenations, casts, reductions, ``select_n``); nested ``jit`` / ``custom_jvp_call``
bodies (composites, ``jax.nn.relu``) are inlined. Integer code as realize writes it maps onto
ONNX's integer kernels: an int8 x int8 -> int32 ``dot_general`` becomes ``MatMulInteger`` and an
int8 convolution ``ConvInteger``, their int8 activations shifted by 128 into uint8 with a zero
point of 128 (exact: ``sum((a + 128 - 128) w) = sum(a w)``), the operand type ONNX Runtime's x86
kernels run fast. The session is called through ``jax.pure_callback``, so a built program stays
jittable. Needs the optional packages ``onnx`` and ``onnxruntime`` (``pip install jaxq[onnx]``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxq import _compat as C
from jaxq._program import Program
from jaxq.partition._backends import BackendError, callback_runner, register_backend, shaped_aval

OPSET = 18

_UNARY = {
    "neg": "Neg", "sin": "Sin", "cos": "Cos", "tanh": "Tanh", "exp": "Exp", "log": "Log",
    "abs": "Abs", "sqrt": "Sqrt", "logistic": "Sigmoid", "sign": "Sign", "copy": "Identity",
    "copy_p": "Identity", "erf": "Erf", "floor": "Floor", "ceil": "Ceil",
    "stop_gradient": "Identity",
}  # fmt: skip
_BINARY = {
    "add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min",
    "pow": "Pow", "gt": "Greater", "lt": "Less", "ge": "GreaterOrEqual", "le": "LessOrEqual",
    "eq": "Equal",
}  # fmt: skip
_OTHER = {
    "dot_general", "broadcast_in_dim", "reshape", "transpose", "convert_element_type",
    "reduce_sum", "reduce_max", "reduce_min", "integer_pow", "select_n", "squeeze",
    "expand_dims", "rsqrt", "square", "round", "clamp", "conv_general_dilated",
    "reduce_window_max", "pad", "is_finite", "not", "and", "or", "reduce_or", "reduce_and",
    "concatenate", "slice", "ne", "erfc",
}  # fmt: skip
_INT8 = (np.dtype(np.int8), np.dtype(np.uint8))
ONNX_PRIMITIVES: frozenset[str] = frozenset(_UNARY.keys() | _BINARY.keys() | _OTHER)
"""Every primitive the exporter has a rule for (``jaxq.partition.backend_ops`` reads it)."""


def _pooled_axes(p: Any) -> list[int]:
    """The axes a ``reduce_window_max`` pools over (a window or stride other than 1)."""
    windows = zip(p["window_dimensions"], p["window_strides"], strict=True)
    return [i for i, (w, s) in enumerate(windows) if w != 1 or s != 1]


def _limit(e: C.JaxprEqn) -> str | None:
    """Why the exporter cannot take this equation of a primitive it knows (None: it can)."""
    name, p = e.primitive.name, e.params
    dtypes = [np.dtype(shaped_aval(v).dtype) for v in e.invars]
    if name == "select_n" and len(e.invars) != 3:
        return "select_n with more than two cases"
    if name == "round" and int(p["rounding_method"]) != 1:
        return "round away from zero (ONNX rounds half to even)"
    ints = [np.issubdtype(d, np.integer) for d in dtypes]
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
    if name == "reduce_window_max":
        pooled = _pooled_axes(p)
        if len(p["window_dimensions"]) - len(pooled) != 2 or not pooled:
            return "max pooling that does not leave exactly two axes unpooled"
        if any(d != 1 for d in (*p["base_dilation"], *p["window_dilation"])):
            return "dilated max pooling"
    if name == "pad" and any(lo < 0 or hi < 0 or i for lo, hi, i in p["padding_config"]):
        return "a pad with interior or negative padding"
    return None


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
    return {v for v, us in users.items() if us <= _BROADCASTING and v not in outs}


class _Exporter:
    def __init__(self, onnx: Any) -> None:
        self.onnx, self.helper = onnx, onnx.helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.count = 0
        self.values: dict[str, np.ndarray] = {}
        """The initializers' values by name (weight layouts are folded into new ones)."""
        self.float_codes: dict[str, tuple[str, Any]] = {}
        """int8 values cast from float: the float value and its dtype (see shifted_u8)."""
        self.negations: dict[str, str] = {}
        """Values that are a ``Not`` of another: that other one."""
        self.broadcasting: set[Any] = set()
        """Values whose every use is an op that broadcasts numpy-style (no Expand needed)."""

    def fresh(self, hint: str = "v") -> str:
        self.count += 1
        return f"{hint}{self.count}"

    def const(self, value: Any, dtype: Any = None) -> str:
        arr = np.asarray(value, dtype=dtype)
        name = self.fresh("c")
        self.inits.append(self.onnx.numpy_helper.from_array(arr, name))
        self.values[name] = arr
        return name

    def reshape(self, x: str, shape: Sequence[int]) -> str:
        if x in self.values:  # a constant (a weight): folded here, so it stays an initializer
            return self.const(self.values[x].reshape(shape))
        return self.node("Reshape", [x, self.const(list(shape), np.int64)])[0]

    def node(self, op: str, ins: list[str], n_out: int = 1, **attrs: Any) -> list[str]:
        outs = [self.fresh() for _ in range(n_out)]
        self.nodes.append(self.helper.make_node(op, ins, outs, **attrs))
        return outs

    def run(self, jaxpr: C.Jaxpr, consts: Sequence[Any], args: Sequence[str]) -> list[str]:
        env: dict[Any, str] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = self.const(c)
        env.update(zip(jaxpr.invars, args, strict=True))
        self.broadcasting |= _broadcast_only(jaxpr)

        def read(a: Any) -> str:
            if C.is_literal(a):
                return self.const(a.val, a.aval.dtype)
            return env[a]

        for e in jaxpr.eqns:
            ins = [read(a) for a in e.invars]
            outs = self.eqn(e, ins)
            env.update(zip(e.outvars, outs, strict=True))
        return [read(a) for a in jaxpr.outvars]

    def eqn(self, e: C.JaxprEqn, ins: list[str]) -> list[str]:
        name, p = e.primitive.name, e.params
        out_aval = shaped_aval(e.outvars[0])
        body = C.inline_body(e)
        if body is not None:
            return self.run(body.jaxpr, body.consts, ins)
        if name in _UNARY:
            return self.node(_UNARY[name], ins)
        if name in _BINARY:
            return self.node(_BINARY[name], ins)
        if name == "rsqrt":
            return self.node("Reciprocal", self.node("Sqrt", ins))
        if name == "square":
            return self.node("Mul", [ins[0], ins[0]])
        if name == "integer_pow" and 1 <= p["y"] <= 4:  # multiplies (ONNX Pow is slow)
            out = ins[0]
            for _ in range(p["y"] - 1):
                out = self.node("Mul", [out, ins[0]])[0]
            return [out]
        if name == "integer_pow":
            y = self.const(p["y"], shaped_aval(e.invars[0]).dtype)
            return self.node("Pow", [ins[0], y])
        if name == "dot_general":
            return self.dot_general(e, ins)
        if name == "broadcast_in_dim":
            shape, dims = p["shape"], p["broadcast_dimensions"]
            expanded = [1] * len(shape)
            for i, d in enumerate(dims):
                expanded[d] = shaped_aval(e.invars[0]).shape[i]
            r = self.node("Reshape", [ins[0], self.const(expanded, np.int64)])
            if e.outvars[0] in self.broadcasting:  # its users broadcast it themselves
                return r
            return self.node("Expand", [r[0], self.const(shape, np.int64)])
        if name in ("reshape", "squeeze", "expand_dims"):
            return self.node("Reshape", [ins[0], self.const(out_aval.shape, np.int64)])
        if name == "transpose":
            return self.node("Transpose", ins, perm=list(p["permutation"]))
        if name == "convert_element_type":
            to = self.helper.np_dtype_to_tensor_dtype(np.dtype(p["new_dtype"]))
            cast = self.node("Cast", ins, to=to)
            src_dtype = np.dtype(shaped_aval(e.invars[0]).dtype)
            if np.dtype(p["new_dtype"]) == np.int8 and np.issubdtype(src_dtype, np.floating):
                self.float_codes[cast[0]] = (ins[0], src_dtype)
            return cast
        if name in ("reduce_sum", "reduce_max", "reduce_min"):
            op = {"reduce_sum": "ReduceSum", "reduce_max": "ReduceMax", "reduce_min": "ReduceMin"}
            axes = self.const(list(p["axes"]), np.int64)
            return self.node(op[name], [ins[0], axes], keepdims=0)
        if name == "select_n":
            which, f, t = ins
            if shaped_aval(e.invars[0]).dtype != np.bool_:
                which = self.node("Cast", [which], to=self.onnx.TensorProto.BOOL)[0]
            return self.node("Where", [which, t, f])
        if name == "round":  # (only half-to-even reaches here: see _limit)
            return self.node("Round", ins)
        if name == "clamp":  # lax.clamp(lo, x, hi)
            lo, x, hi = ins
            return self.node("Max", [self.node("Min", [x, hi])[0], lo])
        if name == "erfc":
            one = self.const(1, shaped_aval(e.invars[0]).dtype)
            return self.node("Sub", [one, self.node("Erf", ins)[0]])
        if name == "ne":
            return self.node("Not", self.node("Equal", ins))
        if name == "is_finite":
            bad = self.node("Or", [self.node("IsNaN", ins)[0], self.node("IsInf", ins)[0]])
            finite = self.node("Not", bad)
            self.negations[finite[0]] = bad[0]
            return finite
        if name == "not" and ins[0] in self.negations:  # not(not(x)) is x
            return [self.negations[ins[0]]]
        if name in ("not", "and", "or"):
            logical = shaped_aval(e.outvars[0]).dtype == np.bool_
            logic_op = {"not": "Not", "and": "And", "or": "Or"}[name]
            return self.node(logic_op if logical else f"Bitwise{logic_op}", ins)
        if name in ("reduce_or", "reduce_and"):  # as a max / min over 0 / 1 bytes
            u8 = self.node("Cast", ins, to=self.onnx.TensorProto.UINT8)
            axes = self.const(list(p["axes"]), np.int64)
            reduce_op = "ReduceMax" if name == "reduce_or" else "ReduceMin"
            reduced = self.node(reduce_op, [u8[0], axes], keepdims=0)
            return self.node("Cast", reduced, to=self.onnx.TensorProto.BOOL)
        if name == "concatenate":
            return self.node("Concat", ins, axis=int(p["dimension"]))
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
            return self.max_pool(e, ins)
        raise BackendError(f"the ONNX exporter has no rule for {name!r}")

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
        if x in self.float_codes:  # integer-valued floats in [-128, 127]: + 128 is exact
            src, dt = self.float_codes[x]
            shifted = self.node("Add", [src, self.const(128, dt)])
            return self.node("Cast", shifted, to=self.onnx.TensorProto.UINT8)[0], self.const(
                128, np.uint8
            )
        wide = self.node("Cast", [x], to=self.onnx.TensorProto.INT16)
        shifted = self.node("Add", [wide[0], self.const(128, np.int16)])
        u8 = self.node("Cast", shifted, to=self.onnx.TensorProto.UINT8)[0]
        return u8, self.const(128, np.uint8)

    def conv(self, e: C.JaxprEqn, ins: list[str]) -> list[str]:
        """``conv_general_dilated`` as ``Conv`` (float) or ``ConvInteger`` (8-bit), in ONNX's
        channels-first layout (transposes around it where the equation's layout differs)."""
        p = e.params
        dn = p["dimension_numbers"]
        x_dtype, w_dtype = (np.dtype(shaped_aval(v).dtype) for v in e.invars)
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
            zps = [zp, self.const(0, w_dtype)] if zp is not None else []
            y = self.node("ConvInteger", [x, w, *zps], **attrs)[0]
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
        w = self.reshape(w, [k, o])
        zps = [zp, self.const(0, wa.dtype)] if zp is not None else []
        y = self.node("MatMulInteger", [col, w, *zps])[0]
        y = self.node("Reshape", [y, self.const([n, *out_sp, o], np.int64)])[0]
        if np.dtype(out_aval.dtype) != np.int32:
            y = self.node("Cast", [y], to=self.helper.np_dtype_to_tensor_dtype(out_aval.dtype))[0]
        # y is [N, spatial..., O]: to the equation's output layout
        perm = [0] * (nsp + 2)
        perm[dn.out_spec[0]], perm[dn.out_spec[1]] = 0, nsp + 1
        for i, d in enumerate(dn.out_spec[2:]):
            perm[d] = 1 + i
        return [self.transpose(y, perm)]

    def max_pool(self, e: C.JaxprEqn, ins: list[str]) -> list[str]:
        """``reduce_window_max`` over all but two axes as ``MaxPool``: the two unpooled axes go
        first (as N and C), the pooled ones after them."""
        p = e.params
        pooled = _pooled_axes(p)
        kept = [i for i in range(len(p["window_dimensions"])) if i not in pooled]
        perm = kept + pooled
        x = self.transpose(ins[0], perm)
        y = self.node(
            "MaxPool",
            [x],
            kernel_shape=[p["window_dimensions"][i] for i in pooled],
            strides=[p["window_strides"][i] for i in pooled],
            pads=[p["padding"][i][0] for i in pooled] + [p["padding"][i][1] for i in pooled],
        )[0]
        return [self.transpose(y, [int(d) for d in np.argsort(perm)])]

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
        x, zp = self.shifted_u8(ins[0], xa.dtype) if integer else (ins[0], None)
        x = self.reshape(self.transpose(x, [*bx, *fx, *cx]), [*lead, m, k])
        y = self.reshape(self.transpose(ins[1], [*by, *cy, *fy]), [*lead, k, n])
        if integer:
            zps = [zp, self.const(0, ya.dtype)] if zp is not None else []
            out = self.node("MatMulInteger", [x, y, *zps])
        else:
            out = self.node("MatMul", [x, y])
        out_aval = shaped_aval(e.outvars[0])
        out = self.node("Reshape", [out[0], self.const(list(out_aval.shape), np.int64)])
        computed = np.dtype(np.int32) if integer else np.dtype(xa.dtype)
        if np.dtype(out_aval.dtype) != computed:
            out = self.node("Cast", out, to=self.helper.np_dtype_to_tensor_dtype(out_aval.dtype))
        return out


def export_onnx(region: Program) -> Any:
    """Export a region (a Program over flat arrays) to an ``onnx.ModelProto``."""
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
    ex = _Exporter(onnx)
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
    used = {i for n in ex.nodes for i in n.input}  # (weights whose layout was folded: gone)
    inits = [t for t in ex.inits if t.name in used]
    graph = h.make_graph(ex.nodes, region.name, inputs, outputs, inits)
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", OPSET)], producer_name="jaxq", ir_version=9
    )
    onnx.checker.check_model(model)
    return model


def onnx_codegen(region: Program) -> Callable[..., Sequence[Any]]:
    """Export the region and open an ONNX Runtime session for it (CPU execution provider). The
    returned callable carries ``.model``, ``.session`` and ``.calls`` (how many times the session
    ran)."""
    model = export_onnx(region)
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise BackendError(
            "the onnxruntime backend needs the 'onnxruntime' package: pip install onnxruntime "
            "(or jaxq[onnx])"
        ) from e
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # one thread per core, and idle threads sleep: spinning ORT threads next to XLA's made the
    # XLA code beside them 3x slower on 2 cores
    opts.intra_op_num_threads = os.cpu_count() or 1
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    session = ort.InferenceSession(
        model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    names = [i.name for i in session.get_inputs()]
    calls = [0]

    def host(*args: Any) -> list[np.ndarray]:
        outs = session.run(None, {n: np.asarray(a) for n, a in zip(names, args, strict=True)})
        calls[0] += 1
        return outs

    run = callback_runner(region, host)
    run.model = model  # type: ignore[attr-defined]
    run.session = session  # type: ignore[attr-defined]
    run.calls = calls  # type: ignore[attr-defined]
    return run


register_backend("onnxruntime", onnx_codegen)
