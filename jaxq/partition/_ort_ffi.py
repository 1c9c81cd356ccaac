"""The ONNX Runtime crossing as an XLA FFI call: the offloaded region runs on XLA's own buffers,
with no Python on the call path (``jax.pure_callback`` costs 0.1-0.15 ms a call, more than the
digits CNN's whole float forward at batch 1).

``_ort_ffi.cc`` is compiled on first use with the C++ compiler found (``$CXX``, else ``g++``)
against the XLA FFI headers of the running jaxlib and cached by the jax and onnxruntime versions
(in ``$JAXQ_CACHE``, else ``~/.cache/jaxq``); it calls the ``libonnxruntime.so`` that the
``onnxruntime`` wheel ships, loaded here. Where that cannot be done (no compiler, no library),
:func:`library` returns None and the backend keeps ``jax.pure_callback``; ``JAXQ_ORT_FFI=0``
asks for that path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

TARGET = "jaxq_ort_run"
_SOURCE = Path(__file__).with_name("_ort_ffi.cc")


def _ort_library() -> Path | None:
    """The C API library inside the onnxruntime wheel."""
    import onnxruntime

    capi = Path(onnxruntime.__file__).parent / "capi"
    found = sorted(capi.glob("libonnxruntime.so*"))
    return found[0] if found else None


def _build(out: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None:
        raise OSError("no C++ compiler ($CXX or g++)")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name  # built aside, then moved: a concurrent build sees whole files
        cmd = [
            cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
            f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(part),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise OSError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(part, out)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled crossing, registered with XLA as ``jaxq_ort_run``; None where it cannot be
    built or loaded here (the backend then crosses with ``jax.pure_callback``)."""
    if os.environ.get("JAXQ_ORT_FFI", "1") == "0" or os.name != "posix":
        return None
    try:
        import onnxruntime

        ort = _ort_library()
        if ort is None:
            return None
        key = "\n".join(
            [_SOURCE.read_text(), jax.ffi.include_dir(), jax.__version__, onnxruntime.__version__]
        )
        cache = Path(os.environ.get("JAXQ_CACHE") or Path.home() / ".cache" / "jaxq")
        cache.mkdir(parents=True, exist_ok=True)
        out = cache / f"ort_ffi_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
        if not out.exists():
            _build(out)
        lib = ctypes.CDLL(str(out))
        base = ctypes.CDLL(str(ort)).OrtGetApiBase
        lib.JaxqOrtInit.restype = ctypes.c_bool
        if not lib.JaxqOrtInit(ctypes.cast(base, ctypes.c_void_p)):
            return None
    except (OSError, ImportError, AttributeError):
        return None
    lib.JaxqOrtOpen.restype = ctypes.c_void_p
    lib.JaxqOrtOpen.argtypes = [
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
        ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
        ctypes.c_char_p, ctypes.c_size_t,
    ]  # fmt: skip
    lib.JaxqOrtCalls.restype = ctypes.c_int64
    lib.JaxqOrtCalls.argtypes = [ctypes.c_void_p]
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxqOrtRun), platform="cpu")
    return lib


class Session:
    """An ONNX Runtime session the FFI call runs (opened with the Python path's options). It
    lives as long as the process: compiled programs hold its address."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        label: str,
        model: bytes,
        inputs: Sequence[str],
        outputs: Sequence[str],
    ) -> None:
        names = lambda ns: (ctypes.c_char_p * len(ns))(*[n.encode() for n in ns])
        error = ctypes.create_string_buffer(4096)
        handle = lib.JaxqOrtOpen(
            repr(label).encode(), model, len(model), os.cpu_count() or 1,
            names(inputs), len(inputs), names(outputs), len(outputs), error, len(error),
        )  # fmt: skip
        if not handle:
            raise RuntimeError(f"ONNX Runtime could not open the model: {error.value.decode()}")
        self._lib, self.handle = lib, int(handle)

    @property
    def calls(self) -> int:
        return int(self._lib.JaxqOrtCalls(self.handle))

    def __call__(self, result: Sequence[jax.ShapeDtypeStruct], *args: Any) -> Sequence[Any]:
        call = jax.ffi.ffi_call(TARGET, list(result), vmap_method="sequential")
        return call(*args, handle=np.int64(self.handle))
