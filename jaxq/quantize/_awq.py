"""AWQ: activation-aware scaling of a weight's input channels before quantizing it.

A few input channels of a transformer layer carry much larger activations than the rest, so the
rounding error of their weights costs the output most. AWQ (Lin et al., 2023) multiplies those
rows of ``W`` by ``s_k > 1`` before quantizing (their relative rounding error shrinks) and divides
the activation by ``s_k`` (a per-channel multiply that XLA fuses into the op producing it): the
product ``(X / s) Q(s W)`` approximates ``X W`` better where it matters. ``s = m^alpha`` with
``m_k`` the channel's activation magnitude, and ``alpha`` picked from a grid on [0, 1] to minimise
the layer's output error over the calibration data.

jaxq's version uses what calibration already collects for GPTQ, the second moment ``H = X^T X``:
the magnitude is ``m_k = sqrt(H_kk)`` (the channel's RMS, where the paper takes its mean
``|x|``) and the error of a candidate is exactly ``tr(E^T H E)`` with ``E = W - Q(s W) / s``, the
summed squared output error on every calibration row (the paper measures it on a sample).
``alpha = 0`` is plain rounding, so the choice is never worse on the calibration data.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

GRID = 20
"""How many values of ``alpha`` are tried, evenly spaced on [0, 1]."""


def awq_factors(
    w: np.ndarray, k_axis: int, gram: np.ndarray, fake_quant: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """Per-input-channel factors ``s`` (float32, length ``K``) for a weight ``w`` contracted
    over ``k_axis``; ``fake_quant(v)`` is the layer's weight scheme applied to ``v`` (quantize
    then dequantize). Channels that never carried a value keep ``s = 1``."""
    w = np.asarray(w, np.float64)
    h = np.asarray(gram, np.float64)
    mag = np.sqrt(np.maximum(np.diag(h), 0.0))
    live = mag > 0
    if not live.any():
        return np.ones(w.shape[k_axis], np.float32)
    shape = [-1 if d == k_axis else 1 for d in range(w.ndim)]
    w2 = np.moveaxis(w, k_axis, 0).reshape(w.shape[k_axis], -1)
    best, best_loss = np.ones(w.shape[k_axis]), np.inf
    for alpha in np.linspace(0.0, 1.0, GRID):
        s = np.ones_like(mag)
        s[live] = mag[live] ** alpha
        s[live] /= np.sqrt(s[live].max() * s[live].min())  # centred around 1 (geometrically)
        s = s.astype(np.float32).astype(np.float64)  # the factors the program will use
        restored = np.asarray(fake_quant((w * s.reshape(shape)).astype(np.float32)), np.float64)
        e = w2 - np.moveaxis(restored / s.reshape(shape), k_axis, 0).reshape(w2.shape)
        loss = float(np.sum((h @ e) * e))
        if loss < best_loss:
            best, best_loss = s, loss
    return best.astype(np.float32)
