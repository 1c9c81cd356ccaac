"""Warnings that point at the user's line, also when jaxq runs inside ``jax.jit``'s tracing.

A fixed ``stacklevel`` counts frames from jaxq's own call, so under ``jax.jit`` it lands inside
JAX (``partial_eval.py``), where a user cannot see what raised it. The first frame outside jax
and jaxq is the line the user wrote.
"""

from __future__ import annotations

import os
import sys
import warnings

import jax

# (the jax package's folder and jaxq's own: this module sits at its top)
_INTERNAL = tuple(os.path.dirname(f) + os.sep for f in (jax.__file__, __file__) if f)


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` at the first caller outside jax and jaxq."""
    level, frame = 1, sys._getframe(1)
    while frame.f_code.co_filename.startswith(_INTERNAL) and frame.f_back is not None:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
