"""Ordinal (cumulative-logit) tier probabilities derived from the continuous score.

P(tier ≤ k | r) = σ(c_k − a·r) for the raw score r, ascending cut points c_k and slope a:
one slope and K−1 cuts, so the probabilities are monotone in the score, agree with the
bands the score picks, and are fitted (weighted maximum likelihood) on *held-out* scores,
which is what makes them honest about unseen kinds of prompt.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize
from scipy.special import expit

from classifier.types import ClassifierError

SMOOTHING_GRID = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def ordinal_probs(raw: np.ndarray, slope: float, cuts: np.ndarray, smoothing: float = 0.0) -> np.ndarray:
    """(n, K) class probabilities for raw scores ``raw`` (n,), mixed with ``smoothing`` of the
    uniform distribution (a held-out kind of prompt can carry a tier its training folds lacked)."""
    r = np.asarray(raw, dtype=np.float64).reshape(-1, 1)
    cdf = expit(np.asarray(cuts, dtype=np.float64)[None, :] - slope * r)
    cdf = np.concatenate([np.zeros((len(r), 1)), cdf, np.ones((len(r), 1))], axis=1)
    p = np.clip(np.diff(cdf, axis=1), 1e-9, 1.0)
    p = p / p.sum(axis=1, keepdims=True)
    return (1.0 - smoothing) * p + smoothing / p.shape[1]


def _unpack(theta: np.ndarray) -> tuple[float, np.ndarray]:
    return float(theta[0]), np.cumsum(np.r_[theta[1], np.exp(theta[2:])])


def fit_ordinal(raw: np.ndarray, y: np.ndarray, n_classes: int,
                weights: np.ndarray | None = None) -> tuple[float, tuple[float, ...]]:
    """(slope, cuts) maximising the weighted likelihood of class indices ``y`` given ``raw``."""
    if n_classes < 2 or len(y) == 0:
        raise ClassifierError("an ordinal model needs at least two classes and one example")
    r = np.asarray(raw, dtype=np.float64)
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    yi = np.asarray(y, dtype=np.int64)
    rs = (r - r.mean()) / (r.std() or 1.0)  # fit on a standardised score, then map back

    def nll(theta: np.ndarray) -> float:
        a, c = _unpack(theta)
        p = ordinal_probs(rs, a, c)
        return float(-(w * np.log(p[np.arange(len(yi)), yi])).sum())

    priors = np.bincount(yi, weights=w, minlength=n_classes).cumsum()[:-1]
    start_cuts = np.log(np.clip(priors, 1e-3, 1 - 1e-3) / np.clip(1 - priors, 1e-3, 1))
    start_cuts = np.maximum.accumulate(start_cuts + np.arange(n_classes - 1) * 1e-3)
    theta0 = np.r_[1.0, start_cuts[0], np.log(np.maximum(np.diff(start_cuts), 1e-3))]
    res = minimize(nll, theta0, method="L-BFGS-B")
    a, c = _unpack(res.x)
    std = r.std() or 1.0
    # σ(c − a·(r − μ)/σ_r) = σ((c + a·μ/σ_r) − (a/σ_r)·r)
    return a / std, tuple(float(x) for x in c + a * r.mean() / std)


def log_loss(probs: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Weighted mean negative log-likelihood of the true classes."""
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=np.float64)
    p = np.clip(probs[np.arange(len(y)), np.asarray(y, dtype=np.int64)], 1e-12, 1.0)
    return float(-(w * np.log(p)).sum() / w.sum())
