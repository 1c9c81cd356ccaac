"""What the host CPU can do, where jaxq's choices depend on it: int8 dot-product instructions.

XLA:CPU's and ONNX Runtime's int8 kernels differ by CPU, not only by version: x86 processors with
VNNI (AVX-512 VNNI or AVX-VNNI) multiply int8 and add in int32 in one instruction; without it
(AVX2) the kernels take slower routes, and ONNX Runtime's uint8 x int8 one saturates in int16.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

VNNI = frozenset({"avx512_vnni", "avx_vnni"})
"""The /proc/cpuinfo flags of x86's int8 dot-product instructions."""


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@functools.cache
def x86_vnni() -> bool | None:
    """Whether this x86 CPU has VNNI; None on other CPUs or where its flags cannot be read (no
    /proc/cpuinfo: not Linux)."""
    if not is_x86():
        return None
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None
    return bool(flags & VNNI)
