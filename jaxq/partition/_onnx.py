"""The ``"onnxruntime"`` backend: export a region to ONNX and run it in ONNX Runtime.

A small exporter covers the ops regions usually hold (elementwise arithmetic and activations,
``dot_general`` as ``Einsum``, broadcasts, reshapes, transposes, casts, reductions, ``select_n``);
nested ``jit`` / ``custom_jvp_call`` bodies (composites, ``jax.nn.relu``) are inlined. The session
is called through ``jax.pure_callback``, so a built program stays jittable. Needs the optional
packages ``onnx`` and ``onnxruntime`` (``pip install jaxq[onnx]``).
"""

from __future__ import annotations

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
}  # fmt: skip
_BINARY = {
    "add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min",
    "pow": "Pow", "gt": "Greater", "lt": "Less", "ge": "GreaterOrEqual", "le": "LessOrEqual",
    "eq": "Equal",
}  # fmt: skip
_OTHER = {
    "dot_general", "broadcast_in_dim", "reshape", "transpose", "convert_element_type",
    "reduce_sum", "reduce_max", "reduce_min", "integer_pow", "select_n", "squeeze",
    "expand_dims", "rsqrt", "square",
}  # fmt: skip
ONNX_PRIMITIVES: frozenset[str] = frozenset(_UNARY.keys() | _BINARY.keys() | _OTHER)
"""Every primitive the exporter has a rule for (``jaxq.partition.backend_ops`` reads it)."""


def unsupported_onnx_primitives(jaxpr: C.Jaxpr) -> set[str]:
    bad: set[str] = set()
    for e in jaxpr.eqns:
        name = e.primitive.name
        body = C.inline_body(e)
        if body is not None:
            bad |= unsupported_onnx_primitives(body.jaxpr)
        elif name not in ONNX_PRIMITIVES:
            bad.add(name)
        elif name == "select_n" and len(e.invars) != 3:
            bad.add("select_n with more than two cases")
    return bad


class _Exporter:
    def __init__(self, onnx: Any) -> None:
        self.onnx, self.helper = onnx, onnx.helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.count = 0

    def fresh(self, hint: str = "v") -> str:
        self.count += 1
        return f"{hint}{self.count}"

    def const(self, value: Any, dtype: Any = None) -> str:
        arr = np.asarray(value, dtype=dtype)
        name = self.fresh("c")
        self.inits.append(self.onnx.numpy_helper.from_array(arr, name))
        return name

    def node(self, op: str, ins: list[str], n_out: int = 1, **attrs: Any) -> list[str]:
        outs = [self.fresh() for _ in range(n_out)]
        self.nodes.append(self.helper.make_node(op, ins, outs, **attrs))
        return outs

    def run(self, jaxpr: C.Jaxpr, consts: Sequence[Any], args: Sequence[str]) -> list[str]:
        env: dict[Any, str] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = self.const(c)
        env.update(zip(jaxpr.invars, args, strict=True))

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
            return self.node("Expand", [r[0], self.const(shape, np.int64)])
        if name in ("reshape", "squeeze", "expand_dims"):
            return self.node("Reshape", [ins[0], self.const(out_aval.shape, np.int64)])
        if name == "transpose":
            return self.node("Transpose", ins, perm=list(p["permutation"]))
        if name == "convert_element_type":
            to = self.helper.np_dtype_to_tensor_dtype(np.dtype(p["new_dtype"]))
            return self.node("Cast", ins, to=to)
        if name in ("reduce_sum", "reduce_max", "reduce_min"):
            op = {"reduce_sum": "ReduceSum", "reduce_max": "ReduceMax", "reduce_min": "ReduceMin"}
            axes = self.const(list(p["axes"]), np.int64)
            return self.node(op[name], [ins[0], axes], keepdims=0)
        if name == "select_n":
            which, f, t = ins
            if shaped_aval(e.invars[0]).dtype != np.bool_:
                which = self.node("Cast", [which], to=self.onnx.TensorProto.BOOL)[0]
            return self.node("Where", [which, t, f])
        raise BackendError(f"the ONNX exporter has no rule for {name!r}")

    def dot_general(self, e: C.JaxprEqn, ins: list[str]) -> list[str]:
        (cx, cy), (bx, by) = e.params["dimension_numbers"]
        nx, ny = shaped_aval(e.invars[0]).ndim, shaped_aval(e.invars[1]).ndim
        letters = iter("abcdefghijklmnopqrstuvwxyz")
        sx = [next(letters) for _ in range(nx)]
        sy = [next(letters) for _ in range(ny)]
        for a, b in zip((*cx, *bx), (*cy, *by), strict=True):
            sy[b] = sx[a]
        batch = [sx[a] for a in bx]
        fx = [s for i, s in enumerate(sx) if i not in cx and i not in bx]
        fy = [s for i, s in enumerate(sy) if i not in cy and i not in by]
        eq = f"{''.join(sx)},{''.join(sy)}->{''.join(batch + fx + fy)}"
        out = self.node("Einsum", ins, equation=eq)
        want = np.dtype(shaped_aval(e.outvars[0]).dtype)
        if want != np.dtype(shaped_aval(e.invars[0]).dtype):
            to = self.helper.np_dtype_to_tensor_dtype(want)
            out = self.node("Cast", out, to=to)
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
    graph = h.make_graph(ex.nodes, region.name, inputs, outputs, ex.inits)
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
