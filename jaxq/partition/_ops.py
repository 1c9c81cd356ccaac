"""Which primitives a backend can run, read from the backends' own tables."""

from __future__ import annotations

from jaxq import _compat as C
from jaxq.partition._backends import HOST_RULES, get_backend, host_codegen
from jaxq.partition._onnx import ONNX_PRIMITIVES, onnx_codegen, unsupported_onnx_equation
from jaxq.partition._support import register_op_support


def backend_ops(backend: str) -> tuple[str, ...] | None:
    """The primitives the backend registered as ``backend`` can run, by name, sorted; None
    when it has no fixed table.

    The built-in table backends answer from the tables they run with, so the list is never out
    of date: ``"host"`` (a numpy rule per primitive) and ``"onnxruntime"`` (an ONNX node per
    primitive; ``select_n`` with two cases only). Both list the calls they inline (``jit``,
    ``pjit``, ``custom_jvp_call``, ``custom_vjp_call``): a call runs when everything inside it
    does. ``"xla"`` runs every primitive JAX lowers and answers None, and so does a backend you
    registered yourself (its codegen says what it cannot run when :func:`jaxq.build` compiles
    a region).

    This is what a backend *runs*, by primitive; some equations of a listed primitive it still
    cannot run (ONNX Runtime: a convolution with input dilation, a negative pad...). What a
    compiler *claims* for its regions is :func:`register_op_support`; to claim exactly what a
    backend runs, conditions included, use :func:`register_backend_support`.

    Raises:
      UnknownBackendError: nothing is registered as ``backend``.
    """
    codegen = get_backend(backend)
    if codegen is host_codegen:
        return tuple(sorted(HOST_RULES.keys() | C.INLINE_CALLS))
    if codegen is onnx_codegen:
        return tuple(sorted(ONNX_PRIMITIVES | C.INLINE_CALLS))
    return None


def register_backend_support(compiler: str, backend: str) -> tuple[str, ...]:
    """Declare that ``compiler`` supports exactly what ``backend`` runs: every primitive of
    :func:`backend_ops`, each with the backend's own conditions (``"onnxruntime"`` takes no
    convolution with input dilation, no negative or interior pad, no integer dot on wider than
    8 bits...), so its regions build there without a fallback. Returns the primitives.

    ::

        register_backend_support("ort", "onnxruntime")
        parts = Sequential([annotate_target(["ort"]), merge_compiler_regions(),
                            partition_graph()])(jaxq.trace(f, x))
        run = jaxq.build(parts, backends={"ort": "onnxruntime"})

    Raises:
      ValueError: the backend has no fixed table (``"xla"``, your own): say what your compiler
        supports with :func:`register_op_support`.
    """
    ops = backend_ops(backend)
    if ops is None:
        raise ValueError(
            f"register_backend_support: backend {backend!r} has no fixed table of what it runs; "
            "declare what the compiler supports with register_op_support"
        )
    runs = (
        (lambda rec: not unsupported_onnx_equation(rec.eqn))
        if get_backend(backend) is onnx_codegen
        else None
    )
    own = tuple(op for op in ops if op not in C.INLINE_CALLS)  # (calls: supported when all is)
    for op in own:
        register_op_support(compiler, op, runs)
    return own
