"""The trained effort model at inference time: plain numpy over the hashed features.

Training (classifier.train) fits scikit-learn estimators and copies their coefficients
here, so a decision is one gather + dot product per head: no scikit-learn call overhead
on the request path. A continuous difficulty score (one coefficient vector) picks the
*band* of tiers through thresholds calibrated to the target mix; per-tier probabilities
(an ordinal model on the same score, or — for models without one — a temperature-scaled
multinomial head) pick the tier inside the band.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp

from classifier.calibrate import bands_from_mix
from classifier.features import DENSE_NAMES, FEATURE_VERSION, N_FEATURES, extract, to_arrays, token_names
from classifier.ordinal import ordinal_probs
from classifier.types import TIER_INDEX, TIERS, ClassifierError, EffortDecision, Message, SparseFeatures

SCORE_SLOPE = 6.0


@dataclass(frozen=True)
class Contribution:
    """One feature's pull on the score (value × weight), for `explain`."""

    name: str
    value: float
    score_weight: float

    @property
    def contribution(self) -> float:
        return self.value * self.score_weight


@dataclass(frozen=True, eq=False)
class EffortModel:
    """Coefficients of both heads plus the decision rule; immutable once built."""

    classes: tuple[str, ...]
    tier_coef: np.ndarray  # (N_FEATURES, n_classes) float32
    tier_intercept: np.ndarray  # (n_classes,) float32
    temperature: float
    score_coef: np.ndarray  # (N_FEATURES,) float32
    score_intercept: float
    thresholds: tuple[float, ...]  # ascending score cut points between bands
    bands: tuple[tuple[str, ...], ...]  # tiers of each band, lowest band first
    version: str = "unversioned"
    feature_version: str = FEATURE_VERSION
    # Training scores at quantiles 0, 1/(n-1), ..., 1: lets the thresholds be re-derived for
    # another target mix without retraining (empty: only the stored thresholds are known).
    score_quantiles: tuple[float, ...] = ()
    # Ordinal tier probabilities on the raw score (classifier.ordinal); when ``ordinal_cuts``
    # is empty the temperature-scaled tier head gives the probabilities instead.
    ordinal_slope: float = 0.0
    ordinal_cuts: tuple[float, ...] = ()
    ordinal_smoothing: float = 0.0  # share of the uniform distribution mixed in

    def __post_init__(self) -> None:
        n = len(self.classes)
        if self.tier_coef.shape != (N_FEATURES, n) or self.tier_intercept.shape != (n,):
            raise ClassifierError(f"tier head has shape {self.tier_coef.shape}, expected {(N_FEATURES, n)}")
        if self.score_coef.shape != (N_FEATURES,):
            raise ClassifierError(f"score head has shape {self.score_coef.shape}, expected {(N_FEATURES,)}")
        if len(self.bands) != len(self.thresholds) + 1:
            raise ClassifierError("need exactly one more band than thresholds")
        if list(self.thresholds) != sorted(self.thresholds):
            raise ClassifierError("thresholds must be ascending")
        if self.ordinal_cuts and len(self.ordinal_cuts) != n - 1:
            raise ClassifierError(f"ordinal model has {len(self.ordinal_cuts)} cuts, expected {n - 1}")
        if any(t not in TIER_INDEX for t in self.classes):
            raise ClassifierError(f"unknown tier among classes {self.classes}")

    def with_target_mix(self, target_mix: Mapping[str, float]) -> EffortModel:
        """The same model with bands and thresholds re-derived for ``target_mix`` on its
        training score distribution."""
        if len(self.score_quantiles) < 2:
            raise ClassifierError(f"model {self.version} has no stored score quantiles; retrain to change its mix")
        bands, shares = bands_from_mix(target_mix)
        grid = np.linspace(0.0, 1.0, len(self.score_quantiles))
        cuts = np.interp(np.cumsum(shares)[:-1], grid, np.asarray(self.score_quantiles))
        cuts = np.maximum.accumulate(np.nextafter(cuts, np.inf))
        return dataclasses.replace(self, thresholds=tuple(float(c) for c in cuts), bands=bands)

    # -- single prompt (request path) ------------------------------------------------
    def decide(self, messages: Sequence[Message]) -> EffortDecision:
        return self.decide_features(extract(messages))

    def decide_features(self, features: SparseFeatures) -> EffortDecision:
        if features.feature_version != self.feature_version:
            raise ClassifierError(f"features are version {features.feature_version}, model expects "
                                  f"{self.feature_version}")
        idx, val = to_arrays(features)
        raw = float(val @ self.score_coef[idx]) + self.score_intercept
        if self.ordinal_cuts:
            probs = ordinal_probs(np.asarray([raw]), self.ordinal_slope, np.asarray(self.ordinal_cuts),
                                  self.ordinal_smoothing)[0]
        else:
            logits = val @ self.tier_coef[idx] + self.tier_intercept
            probs = _softmax(logits[None, :] / self.temperature)[0]
        return self._decision(float(squash_score(raw)), probs)

    def _decision(self, score: float, probs: np.ndarray) -> EffortDecision:
        full = dict.fromkeys(TIERS, 0.0)
        for cls, p in zip(self.classes, probs, strict=True):
            full[cls] = float(p)
        band = self.bands[int(np.searchsorted(np.asarray(self.thresholds), score, side="right"))]
        tier = max(band, key=lambda t: (full[t], -TIER_INDEX[t]))
        return EffortDecision(tier=tier, score=score, probabilities=full, version=self.version)

    # -- batches (training, evaluation) ----------------------------------------------
    def predict_matrix(self, X: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray]:
        """(calibrated probabilities over ``classes`` (n, k), scores (n,)) for a feature matrix."""
        raw = np.asarray(X @ self.score_coef).ravel() + self.score_intercept
        if self.ordinal_cuts:
            probs = ordinal_probs(raw, self.ordinal_slope, np.asarray(self.ordinal_cuts), self.ordinal_smoothing)
        else:
            probs = _softmax((np.asarray(X @ self.tier_coef) + self.tier_intercept) / self.temperature)
        return probs, squash_score(raw)

    def decisions_matrix(self, X: sp.csr_matrix) -> list[EffortDecision]:
        probs, scores = self.predict_matrix(X)
        return [self._decision(float(s), p) for s, p in zip(scores, probs, strict=True)]

    def explain(self, messages: Sequence[Message], top: int = 10) -> tuple[EffortDecision, list[Contribution]]:
        """The decision plus the features that pushed the score most (either way)."""
        features = extract(messages)
        names = token_names(messages)
        contribs = [Contribution(names.get(i, f"hash:{i}"), v, float(self.score_coef[i]))
                    for i, v in zip(features.indices, features.values, strict=True)]
        contribs.sort(key=lambda c: abs(c.contribution), reverse=True)
        return self.decide_features(features), contribs[:top]


def squash_score(raw: Any) -> Any:
    """Map the regression output into (0, 1) monotonically (a logistic centred on 0.5).

    Clipping would tie every prompt beyond the ends, and ties defeat threshold calibration
    and ranking; the squash keeps the order and the [0, 1] reading (0.5 stays 0.5).
    """
    return 1.0 / (1.0 + np.exp(-SCORE_SLOPE * (np.asarray(raw, dtype=np.float64) - 0.5)))


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


__all__ = ["DENSE_NAMES", "SCORE_SLOPE", "Contribution", "EffortModel", "squash_score"]
