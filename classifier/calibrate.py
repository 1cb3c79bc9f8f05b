"""Calibration: temperature scaling of the tier probabilities, thresholds that hit a
target tier mix, and the expected calibration error used to report both.

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from scipy.optimize import minimize_scalar

from classifier.types import TIER_INDEX, TIERS, ClassifierError

DEFAULT_TARGET_MIX: dict[str, float] = {"low": 0.70, "medium": 0.20, "high": 0.10}


def bands_from_mix(target_mix: Mapping[str, float]) -> tuple[tuple[tuple[str, ...], ...], tuple[float, ...]]:
    """Bands of tiers and their target shares from a mix such as ``{low: .7, medium: .2, high: .1}``.

    Each named tier closes a band that starts after the previous named tier; the last
    band runs up to the top tier. So the default mix means none..low 70%, medium 20%,
    high..xhigh 10%.
    """
    if not target_mix:
        raise ClassifierError("target_mix is empty")
    unknown = [t for t in target_mix if t not in TIER_INDEX]
    if unknown:
        raise ClassifierError(f"target_mix names unknown tiers: {unknown}")
    shares = np.asarray([target_mix[t] for t in target_mix], dtype=float)
    if (shares < 0).any() or shares.sum() <= 0:
        raise ClassifierError("target_mix shares must be non-negative and not all zero")
    named = sorted(target_mix, key=lambda t: TIER_INDEX[t])
    bands: list[tuple[str, ...]] = []
    start = 0
    for i, t in enumerate(named):
        end = len(TIERS) if i == len(named) - 1 else TIER_INDEX[t] + 1
        bands.append(TIERS[start:end])
        start = end
    total = sum(target_mix.values())
    return tuple(bands), tuple(target_mix[t] / total for t in named)


def weighted_quantiles(values: np.ndarray, qs: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    v = np.asarray(values, dtype=float)[order]
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=float)[order]
    cdf = np.cumsum(w) / w.sum()
    return v[np.minimum(np.searchsorted(cdf, qs, side="left"), len(v) - 1)]


def calibrate_thresholds(scores: np.ndarray, shares: tuple[float, ...],
                         weights: np.ndarray | None = None) -> tuple[float, ...]:
    """Score cut points so that the bands receive ``shares`` of ``scores`` (ties go up)."""
    if len(scores) == 0:
        raise ClassifierError("cannot calibrate thresholds on no scores")
    cum = np.cumsum(shares)[:-1]
    cuts = weighted_quantiles(np.asarray(scores), cum, weights)
    # `searchsorted(..., side="right")` puts a score equal to a cut above it, so nudge
    # each cut just past the quantile value to keep that value in the lower band.
    cuts = np.nextafter(cuts, np.inf)
    return tuple(float(c) for c in np.maximum.accumulate(cuts))


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
