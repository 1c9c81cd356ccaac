"""Which primitives a backend can run, read from the backends' own tables."""

from __future__ import annotations

from jaxq import _compat as C
from jaxq.partition._backends import HOST_RULES, get_backend, host_codegen
from jaxq.partition._onnx import ONNX_PRIMITIVES, onnx_codegen


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

    This is what a backend *runs*; what a compiler *claims* for its regions is
    :func:`register_op_support`. Partitioning for exactly what a backend runs::

        for op in backend_ops("onnxruntime"):
            register_op_support("ort", op)
        run = jaxq.build(parts, backends={"ort": "onnxruntime"})

    Raises:
      UnknownBackendError: nothing is registered as ``backend``.
    """
    codegen = get_backend(backend)
    if codegen is host_codegen:
        return tuple(sorted(HOST_RULES.keys() | C.INLINE_CALLS))
    if codegen is onnx_codegen:
        return tuple(sorted(ONNX_PRIMITIVES | C.INLINE_CALLS))
    return None
