"""GPTQ: choose weight codes that minimise the layer's *output* error on calibration data.

Rounding each weight to its nearest code minimises ``||W - Q||``; what matters is ``||X W - X Q||``.
GPTQ (Frantar et al., 2022) quantizes the contracted rows of ``W`` one at a time and spreads each
row's rounding error over the rows not yet quantized, weighted by the inverse of the activations'
second moment ``H = X^T X`` (collected during calibration). Scales stay those of the scheme, so the
codes are ordinary int8 codes: only their choice changes. Rows are visited by decreasing ``H_kk``
(activation order) in blocks of ``BLOCK`` with lazy updates, as in the paper.

``damp`` is added to ``H``'s diagonal as a share of its mean: with few calibration tokens ``H`` is
rank deficient, and a larger damping keeps the compensation from fitting the calibration set.
"""

from __future__ import annotations

import numpy as np

BLOCK = 128


def gptq_codes(
    w: np.ndarray,
    scale: np.ndarray,
    zero_point: np.ndarray,
    qrange: tuple[int, int],
    gram: np.ndarray,
    damp: float,
) -> np.ndarray:
    """Codes (float64, in ``qrange``) for ``w`` of shape ``[K, N]`` (contracted axis first), with
    ``scale`` / ``zero_point`` broadcastable to it and ``gram`` the ``[K, K]`` second moment."""
    qmin, qmax = qrange
    k = w.shape[0]
    s = np.broadcast_to(np.asarray(scale, np.float64), w.shape)
    z = np.broadcast_to(np.asarray(zero_point, np.float64), w.shape)
    h = np.array(gram, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0  # inputs that were always zero: nothing to compensate
    h[np.diag_indices(k)] += damp * np.mean(np.diag(h))
    order = np.argsort(-np.diag(h), kind="stable")
    h = h[order][:, order]
    w = np.array(w, np.float64)[order]
    s, z = s[order], z[order]
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper Cholesky factor of H^-1
    q = np.empty_like(w)
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        block = w[i1:i2].copy()
        err = np.empty_like(block)
        for i in range(i2 - i1):
            r = i1 + i
            q[r] = np.clip(np.rint(block[i] / s[r]) + z[r], qmin, qmax)
            e = (block[i] - (q[r] - z[r]) * s[r]) / u[r, r]
            block[i + 1 :] -= np.outer(u[r, r + 1 : i2], e)
            err[i] = e
        w[i2:] -= u[i1:i2, i2:].T @ err
    out = np.empty_like(q)
    out[order] = q
    return out
