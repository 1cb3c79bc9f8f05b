"""The gain head: where a stronger arm paid, learned from outcome sets, added to the score.

The source-derived score says how *hard* a prompt is; an outcome set says, per prompt, how much
the strong arm gained over the cheap one (``strong − cheap``). Difficulty and gain are not the
same thing — thinking first helps on a sequence of small steps, barely on recall or judgement of
tone, however hard — so the score is the sum of both:

    raw = source score + weight × scale × gain(x)

``gain(x)`` is a ridge regression of the measured gain on the **dense cues only** (never the
hashed n-grams: they would recognise a task's template instead of the kind of work it asks for),
with features standardised and every group (task) weighted equally, so a large task does not
decide what "pays" means. Its L2 strength is chosen by leave-one-group-out inside the training
groups (nested: the groups a reported figure holds out never choose it). ``scale`` makes the two
parts equally spread on the outcome rows (std(source score) / std(gain)), so ``weight`` = 1 is an
equal-weight prior, not a tuned number. Being linear in the dense features, the head folds into the
model's score coefficients: a decision costs exactly what it did.

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from sklearn.linear_model import Ridge

from classifier.evaluate import metrics
from classifier.features import N_DENSE

GAIN_ALPHAS: tuple[float, ...] = (100.0, 300.0, 1000.0, 3000.0, 10000.0)


@dataclass(frozen=True)
class GainHead:
    """gain(x) = dense(x) @ coef + intercept, in the raw units of the dense features."""

    coef: np.ndarray  # (N_DENSE,)
    intercept: float
    alpha: float
    n_rows: int
    n_groups: int
    inner_apgr: dict[float, float]  # alpha → leave-one-group-out APGR inside the training groups

    def predict(self, X: sp.csr_matrix | np.ndarray) -> np.ndarray:
        return np.asarray(_dense(X) @ self.coef).ravel() + self.intercept


def _dense(X: sp.csr_matrix | np.ndarray) -> np.ndarray:
    if sp.issparse(X):
        return np.asarray(sp.csr_matrix(X)[:, :N_DENSE].toarray(), dtype=np.float64)
    return np.asarray(X, dtype=np.float64)[:, :N_DENSE]


def _group_weights(groups: np.ndarray) -> np.ndarray:
    _, codes, counts = np.unique(groups.astype(str), return_inverse=True, return_counts=True)
    w = 1.0 / counts[codes]
    return w * (len(w) / w.sum())


def _fit(D: np.ndarray, gain: np.ndarray, w: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
    mu = np.average(D, axis=0, weights=w)
    sd = np.sqrt(np.average((D - mu) ** 2, axis=0, weights=w))
    sd = np.where(sd > 1e-6, sd, 1.0)
    reg = Ridge(alpha=alpha).fit((D - mu) / sd, gain, sample_weight=w)
    coef = reg.coef_ / sd
    return coef, float(reg.intercept_ - mu @ coef)


def fit_gain_head(X: sp.csr_matrix | np.ndarray, cheap: np.ndarray, strong: np.ndarray,
                  groups: Sequence[str] | np.ndarray,
                  alphas: Sequence[float] = GAIN_ALPHAS) -> GainHead:
    """Fit on outcome rows (features, cheap and strong outcomes, group of each row). With three or
    more groups the L2 strength is the one whose leave-one-group-out predictions route best (APGR);
    with fewer, the middle of ``alphas``."""
    D = _dense(X)
    c, s = np.asarray(cheap, dtype=float), np.asarray(strong, dtype=float)
    gain = s - c
    g = np.asarray(groups, dtype=object).astype(str)
    w = _group_weights(g)
    names = sorted(set(g.tolist()))
    inner: dict[float, float] = {}
    alpha = float(alphas[len(alphas) // 2])
    if len(names) >= 3 and len(alphas) > 1:
        for a in alphas:
            pred = np.zeros(len(gain))
            for name in names:
                test = g == name
                tr = ~test
                coef, b = _fit(D[tr], gain[tr], _group_weights(g[tr]), a)
                pred[test] = D[test] @ coef + b
            inner[float(a)] = metrics(pred, c, s).apgr
        alpha = max(inner, key=lambda a: (inner[a], a))
    coef, b = _fit(D, gain, w, alpha)
    return GainHead(coef, b, alpha, len(gain), len(names), inner)


def combine_scale(base_raw: np.ndarray, gain_pred: np.ndarray, weight: float) -> float:
    """``weight`` × std(source score) / std(gain) on the outcome rows (0 when either is constant)."""
    sg = float(np.std(gain_pred))
    if weight <= 0 or sg <= 1e-12:
        return 0.0
    return weight * float(np.std(base_raw)) / sg


def fold_gain(coef: np.ndarray, intercept: float, head: GainHead, scale: float) -> tuple[np.ndarray, float]:
    """Score coefficients with ``scale`` × the gain head added (dense columns only)."""
    out = np.asarray(coef, dtype=np.float32).copy()
    out[:N_DENSE] += (scale * head.coef).astype(np.float32)
    return out, float(intercept + scale * head.intercept)
