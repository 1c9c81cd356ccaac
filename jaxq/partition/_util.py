"""Small helpers shared by the partition passes."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a pass rebuilds a big jaxpr.

    A pass allocates O(equations) new, acyclic objects (equations, variables); with the collector on,
    each burst of allocations triggers full collections that walk the whole heap, which makes the
    passes look superlinear on programs of 10k+ equations. Reference counting still frees memory
    while paused; cycles are collected after the pass. The previous state is restored.
    """
    was_enabled = gc.isenabled()
    if was_enabled:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
