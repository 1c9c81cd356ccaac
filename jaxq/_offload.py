"""offload: a quantized function whose integer code runs in an external runtime's int8 kernels.

This is where jaxq's two halves meet, as TVM's bring-your-own-codegen meant them to: realize
writes integer code (int8 x int8 -> int32 dots and convolutions, requantization, the float ops
between layers), and the ordinary partition passes hand it to a backend. ``offload`` is only that
composition, per input shape:

    trace(qf with its params bound)  ->  unroll_loops()  ->  fold_constants()
        ->  annotate_target([backend])  ->  merge_compiler_regions()  ->  partition_graph()
        ->  build(backends={backend: backend})

The params are bound into the traced program, so a region's weights reach the backend as
constants (ONNX initializers, which ONNX Runtime prepacks) instead of arriving on every call;
a scanned layer stack (``nn.scan``) is unrolled into its layers, each with its own slice of the
stacked codes, so it can join a region.
Equations the backend cannot take stay with XLA; each shape that leaves some behind says which,
once, with a warning.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from jaxq import _compat as C
from jaxq._program import Program, trace
from jaxq._warnings import warn
from jaxq.partition import (
    annotate_target,
    backend_ops,
    build,
    merge_compiler_regions,
    partition_graph,
    regions,
    register_op_support,
)
from jaxq.partition._onnx import onnx_codegen, unsupported_onnx_equation
from jaxq.quantize import QuantizedFunction, Tuning
from jaxq.quantize._api import _no_derivative as no_derivative
from jaxq.quantize._api import _spec as arg_spec
from jaxq.transform import PassContext, Sequential, fold_constants, unroll_loops

TUNING = {
    "onnxruntime": Tuning(
        float_carry_max_rows=0,
        s8_pad_single_row=False,
        s8_conv_min_channels=1,
        s8_pooled_conv_min_channels=1,
        conv_taps_max=0,
        conv_im2col_bytes=(0, 0),
        pool_codes=True,
        weights_in_turn=False,
        weight_pieces=0,
    ),
}
"""How realize lowers for a backend's kernels: ONNX Runtime's integer GEMM takes every dot and
convolution in int8 (XLA:CPU's lowering tricks, f32-carried sums and shifted-slice convolutions,
only cost it extra elementwise ops), max pooling on codes lets a convolution requantize
straight to the next layer's codes (one ``QLinearConv``), and its weights are initializers (no
scheduling barriers)."""


class OffloadWarning(UserWarning):
    """Part of a program stays with XLA because the backend cannot run it."""


def _register(backend: str) -> None:
    """The backend's op-support table, from what its exporter takes (dtype and params limits
    included), registered as the compiler of the same name."""
    ops = backend_ops(backend)
    if backend not in TUNING or ops is None:
        raise ValueError(
            f"offload: backend {backend!r} is not one whose integer kernels jaxq checks against "
            f"XLA; offload works with {sorted(TUNING)} (partition for your own backend with "
            "jaxq.partition.register_op_support and jaxq.build)"
        )

    def takes(rec: Any) -> bool:  # (the exporter's dtype and param limits too)
        return not unsupported_onnx_equation(rec.eqn)

    for op in ops:
        register_op_support(backend, op, takes)


class OffloadedFunction:
    """``qf``'s integer function with its backend-supported code in ``backend``'s kernels.

    Call it like ``qf`` (``fast(x)``), eagerly or under ``jax.jit`` / ``jax.vmap`` (XLA calls
    ONNX Runtime on its own buffers through an FFI call, or through ``jax.pure_callback`` where
    jaxq's small C++ crossing cannot be built; see the partition docs). Each new input shape
    is traced, partitioned and built once. ``fast.regions(x)`` lists what runs where for inputs like ``x``; ``fast.program(x)`` is
    the partitioned Program.
    """

    def __init__(
        self, qf: QuantizedFunction, backend: str, exact: bool = False, max_unroll: int = 64
    ) -> None:
        self.qf, self.backend, self.exact, self.max_unroll = qf, backend, exact, max_unroll
        self.params = qf.params  # (as offload was called: every shape runs the same weights)
        self._built: dict[Any, tuple[Program, Callable[..., Any]]] = {}

    def _get(self, args: tuple[Any, ...]) -> tuple[Program, Callable[..., Any]]:
        leaves, tree = jax.tree.flatten(args)
        specs = [arg_spec(x) for x in leaves]
        key = (tree, tuple((s.shape, s.dtype) for s in specs))
        hit = self._built.get(key)
        if hit is None:
            qf = self.qf
            a = jax.tree.unflatten(tree, specs)
            with PassContext(config={"quantize.tuning": TUNING[self.backend]}):
                # (the integer program for the backend's kernels, without apply's wrapper)
                fun = qf.specialize(*a).as_fun()
            params = self.params
            bound = fun if params is None else lambda *x: fun(params, *x)
            program = trace(bound, *a)
            passes = [
                unroll_loops(self.max_unroll),  # (a layer stack as layers a region can take)
                fold_constants(),  # (scale arithmetic on the bound params: constants)
                annotate_target([self.backend]),
                merge_compiler_regions(),
                partition_graph(),
            ]
            parts = Sequential(passes, name="offload")(program)
            left = _left_behind(parts)
            if left:
                named = "; ".join(
                    f"{why}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                    for why, names in sorted(left.items())
                )
                warn(
                    f"offload: {sum(map(len, left.values()))} equation(s) stay with XLA, which "
                    f"{self.backend!r} cannot run ({named})",
                    OffloadWarning,
                )
            codegen = functools.partial(onnx_codegen, exact=self.exact)
            codegen.__name__ = self.backend  # type: ignore[attr-defined]  # (build's messages)
            run = build(parts, backends={self.backend: codegen}, fallback="xla")
            hit = self._built[key] = (parts, run)
        return hit

    def __call__(self, *args: Any) -> Any:
        # (integer code has no derivative: jax.grad says so, not the FFI call's missing rule)
        return no_derivative(self._get(args)[1])(*args)

    def program(self, *args: Any) -> Program:
        """The partitioned Program for inputs shaped like ``args``."""
        return self._get(args)[0]

    def regions(self, *args: Any) -> list[Any]:
        """The regions (:class:`jaxq.partition.RegionInfo`) the backend runs for inputs shaped
        like ``args``."""
        return regions(self._get(args)[0])

    def __repr__(self) -> str:
        return f"OffloadedFunction({self.backend!r}, {self.qf!r})"


def _left_behind(parts: Program) -> dict[str, list[str]]:
    """Why -> the names of the equations that run outside every region (on XLA) for that
    reason, not counting the region calls themselves and layout-only glue."""
    inside = {r.name for r in regions(parts)}
    glue = {"reshape", "broadcast_in_dim", "convert_element_type", "squeeze", "expand_dims"}
    out: dict[str, list[str]] = {}
    for path, name, _, e in parts.walk_names():
        if len(path) > 1 or C.call_name(e) in inside or e.primitive.name in glue:
            continue  # (top level only: a call's own equations go where the call goes)
        whys = sorted(unsupported_onnx_equation(e))  # (primitive names, or why in words)
        why = ", ".join(w if " " in w else f"no ONNX rule for {w}" for w in whys)
        why = why or "outside any region"
        out.setdefault(why, []).append(name)
    return out


def offload(
    qf: QuantizedFunction,
    backend: str = "onnxruntime",
    *,
    exact: bool = False,
    max_unroll: int = 64,
) -> OffloadedFunction:
    """``qf``'s integer code run by an external runtime, through jaxq's own partitioner.

    Example::

        qf = jaxq.quantize(model.apply, params, calibration=batches)
        fast = jaxq.offload(qf, "onnxruntime")      # needs jaxq[onnx]
        y = jax.jit(fast)(x)                        # int8 regions in ONNX Runtime's kernels
        print(fast.regions(x))                      # what runs where

    Whatever ``backend`` cannot run stays with XLA, named in an :class:`OffloadWarning`. The
    backend's op support (what its exporter takes, dtype and param limits included) is registered
    as the compiler of the same name (:func:`jaxq.partition.register_op_support`), so the
    partition passes can be run by hand too.

    Args:
      qf: a realized function from :func:`jaxq.quantize`. Its params, as they are when
        ``offload`` is called, are bound in (the backend gets the weights once, as constants);
        after changing ``qf.params``, call ``offload`` again.
      backend: ``"onnxruntime"``, the backend whose integer kernels jaxq checks against XLA
        bit for bit (the host backend's float division rounds apart from XLA's, so quantized
        codes would differ).
      exact: keep every integer equal to ``qf``'s. By default a convolution whose int32 sums
        realize only requantizes to the next layer's codes (conv -> bias -> ReLU -> conv) runs
        as one ``QLinearConv``, which rounds that requantize in float: each such code is ``qf``'s
        or one step from it (ONNX Runtime's own static quantization rounds the same way).
        ``exact=True`` keeps realize's float rescale and rounding there (slower): each integer
        op then computes ``qf``'s integers from the same codes, while the float ops between
        layers (a GroupNorm, a SiLU) may round their last bit apart from XLA's, which can move
        a later layer's code by one step where a value sits on a rounding boundary (as jitted
        and eager XLA differ).
      max_unroll: a ``lax.scan`` of at most this many iterations (an ``nn.scan`` layer stack)
        is unrolled (:func:`jaxq.transform.unroll_loops`) so that its layers can run in the
        backend; longer loops (a long decode loop) stay with XLA, and 0 keeps every loop there.
    """
    if not isinstance(qf, QuantizedFunction):
        raise TypeError(
            f"offload: expected the QuantizedFunction jaxq.quantize returns; got "
            f"{type(qf).__name__}"
        )
    if qf.mode != "realize":
        raise ValueError(
            f"offload: qf runs in mode {qf.mode!r}; offload the integer function "
            "(jaxq.quantize(..., mode='realize'), or qf.realize(params) after QAT)"
        )
    if backend == "onnxruntime":
        try:
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "offload to 'onnxruntime' needs the onnx and onnxruntime packages: "
                "pip install 'jaxq[onnx]'"
            ) from e
    if not isinstance(max_unroll, int) or max_unroll < 0:
        raise ValueError(f"offload: max_unroll must be an int >= 0; got {max_unroll!r}")
    _register(backend)
    return OffloadedFunction(qf, backend, exact, max_unroll)
