"""Calibration of the tier probabilities: temperature scaling and the expected calibration error
used to report it. (Routing thresholds live in classifier.thresholds.)

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize_scalar


def _nll(logits: np.ndarray, y: np.ndarray, w: np.ndarray, temperature: float) -> float:
    z = logits / temperature
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-(w * logp[np.arange(len(y)), y]).sum() / w.sum())


def fit_temperature(logits: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> float:
    """The temperature minimising held-out negative log-likelihood (1.0 = unchanged)."""
    if len(y) == 0:
        return 1.0
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=float)
    res = minimize_scalar(lambda lt: _nll(logits, y, w, float(np.exp(lt))), bounds=(-3.0, 3.0),
                          method="bounded")
    return float(np.exp(res.x))


def expected_calibration_error(probs: np.ndarray, y: np.ndarray, n_bins: int = 10) -> float:
    """Top-label ECE: |accuracy − confidence| averaged over equal-width confidence bins."""
    if len(y) == 0:
        return 0.0
    conf = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == y).astype(float)
    bins = np.minimum((conf * n_bins).astype(int), n_bins - 1)
    ece = 0.0
    for b in range(n_bins):
        m = bins == b
        if m.any():
            ece += m.mean() * abs(correct[m].mean() - conf[m].mean())
    return float(ece)
