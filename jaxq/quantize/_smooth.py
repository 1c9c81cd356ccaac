"""SmoothQuant: move activation outliers into the weights before quantizing both.

Transformer activations have a few input channels far larger than the rest, so a per-tensor
activation scale wastes most of its codes on them, while weights are easy to quantize. For a
matmul ``X W`` the product is unchanged by ``(X / s) (s W)`` for any positive per-input-channel
``s``; SmoothQuant (Xiao et al., 2022) picks ``s_k = max|X_k|^alpha / max|W_k|^(1 - alpha)`` from
calibration data, which evens the channels of ``X / s`` at a modest cost to ``s W``. The division
fuses into the activation's quantize, and ``s W`` is quantized once, so it costs nothing per call.
"""

from __future__ import annotations

import numpy as np

LIMIT = 1e5
"""Factors are clipped to ``[1 / LIMIT, LIMIT]``."""


def smoothing_factors(
    act_absmax: np.ndarray, w: np.ndarray, k_axis: int, alpha: float
) -> np.ndarray:
    """Per-input-channel factors ``s`` (float32, length ``K``) for a weight ``w`` contracted over
    ``k_axis``; channels that were always zero (in the data or the weight) keep ``s = 1``."""
    w_absmax = (
        np.abs(np.moveaxis(np.asarray(w, np.float64), k_axis, 0))
        .reshape(w.shape[k_axis], -1)
        .max(1)
    )
    return factors(act_absmax, w_absmax, alpha)


def factors(act_absmax: np.ndarray, w_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """``s = max|X|^alpha / max|W|^(1 - alpha)`` per input channel, from both ranges."""
    a = np.asarray(act_absmax, np.float64)
    wa = np.asarray(w_absmax, np.float64)
    live = (a > 0) & (wa > 0)
    s = np.ones_like(a)
    s[live] = a[live] ** alpha / wa[live] ** (1.0 - alpha)
    return np.clip(s, 1.0 / LIMIT, LIMIT).astype(np.float32)
