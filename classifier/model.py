"""The trained effort model at inference time: plain numpy over the hashed features.

Training (classifier.train) fits scikit-learn estimators and copies their coefficients
here, so a decision is one gather + dot product: no scikit-learn call overhead on the
request path. A continuous score (one coefficient vector; higher = extra reasoning pays
more) picks the tier through five thresholds: six single-tier bands, so the tier ordering
carries the score's ranking and every tier is reachable. The thresholds come from the
scores of the traffic the model serves (``traffic``: a ``ScoreWindow`` of recent scores)
once it has seen enough, before that from the stored reference quantiles. Per-tier
probabilities (an ordinal model on the same score, or a temperature-scaled multinomial
head for models without one) are reported alongside; they follow the score.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp

from classifier.features import (
    DENSE_NAMES,
    FEATURE_VERSION,
    N_FEATURES,
    extract,
    extract_arrays,
    to_arrays,
    token_names,
)
from classifier.ordinal import ordinal_probs
from classifier.thresholds import DEFAULT_TIER_MIX, ScoreWindow, full_mix
from classifier.types import (
    TIER_INDEX,
    TIERS,
    ClassifierError,
    EffortDecision,
    Message,
    SparseFeatures,
    user_prompt,
)

SCORE_SLOPE = 6.0
SINGLE_TIER_BANDS: tuple[tuple[str, ...], ...] = tuple((t,) for t in TIERS)


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
class TenantCorrection:
    """A tenant's learned adjustment of the raw score: sparse weights (sorted column indices) + bias."""

    indices: np.ndarray  # (k,) int64, ascending
    values: np.ndarray  # (k,) float32
    bias: float = 0.0

    def __call__(self, idx: np.ndarray, val: np.ndarray) -> float:
        if len(self.indices) == 0:
            return self.bias
        pos = np.minimum(np.searchsorted(self.indices, idx), len(self.indices) - 1)
        hit = self.indices[pos] == idx
        return self.bias + float(val[hit] @ self.values[pos[hit]])


def _default_shares() -> tuple[float, ...]:
    return full_mix(DEFAULT_TIER_MIX)


@dataclass(frozen=True, eq=False)
class EffortModel:
    """Coefficients of both heads plus the decision rule; immutable once built (``traffic`` is the
    one mutable part: the window of recent scores the thresholds are calibrated on)."""

    classes: tuple[str, ...]
    tier_coef: np.ndarray  # (N_FEATURES, n_classes) float32
    tier_intercept: np.ndarray  # (n_classes,) float32
    temperature: float
    score_coef: np.ndarray  # (N_FEATURES,) float32
    score_intercept: float
    thresholds: tuple[float, ...]  # five ascending score cut points between the six tiers
    bands: tuple[tuple[str, ...], ...] = SINGLE_TIER_BANDS  # one tier per band
    version: str = "unversioned"
    feature_version: str = FEATURE_VERSION
    # Reference scores at quantiles 0, 1/(n-1), ..., 1 (a family-balanced mix of the training
    # prompts): the thresholds before the traffic window is warm, for any target mix.
    score_quantiles: tuple[float, ...] = ()
    # Ordinal tier probabilities on the raw score (classifier.ordinal); when ``ordinal_cuts``
    # is empty the temperature-scaled tier head gives the probabilities instead.
    ordinal_slope: float = 0.0
    ordinal_cuts: tuple[float, ...] = ()
    ordinal_smoothing: float = 0.0  # share of the uniform distribution mixed in
    tier_shares: tuple[float, ...] = field(default_factory=_default_shares)  # target share per tier
    tenants: Mapping[str, TenantCorrection] = field(default_factory=dict)
    parent_version: str | None = None
    traffic: ScoreWindow | None = None  # recent decision scores (None: stored thresholds only)

    def __post_init__(self) -> None:
        n = len(self.classes)
        if self.tier_coef.shape != (N_FEATURES, n) or self.tier_intercept.shape != (n,):
            raise ClassifierError(f"tier head has shape {self.tier_coef.shape}, expected {(N_FEATURES, n)}")
        if self.score_coef.shape != (N_FEATURES,):
            raise ClassifierError(f"score head has shape {self.score_coef.shape}, expected {(N_FEATURES,)}")
        if len(self.thresholds) != len(TIERS) - 1 or self.bands != SINGLE_TIER_BANDS:
            raise ClassifierError(f"need {len(TIERS) - 1} thresholds between the six single-tier bands")
        if list(self.thresholds) != sorted(self.thresholds):
            raise ClassifierError("thresholds must be ascending")
        if len(self.tier_shares) != len(TIERS):
            raise ClassifierError("tier_shares needs one share per tier")
        if self.ordinal_cuts and len(self.ordinal_cuts) != n - 1:
            raise ClassifierError(f"ordinal model has {len(self.ordinal_cuts)} cuts, expected {n - 1}")
        if any(t not in TIER_INDEX for t in self.classes):
            raise ClassifierError(f"unknown tier among classes {self.classes}")

    def with_target_mix(self, target_mix: Mapping[str, float]) -> EffortModel:
        """The same model aiming at ``target_mix`` (full or partial, see thresholds.full_mix): the
        stored thresholds are re-derived on the reference quantiles; the traffic window, when
        warm, applies the new shares to live scores."""
        shares = full_mix(target_mix)
        return dataclasses.replace(self, tier_shares=shares, thresholds=self.reference_thresholds(shares))

    def with_shares(self, shares: Sequence[float]) -> EffortModel:
        s = tuple(float(x) for x in shares)
        return dataclasses.replace(self, tier_shares=s, thresholds=self.reference_thresholds(s))

    def with_traffic(self, window: ScoreWindow | None) -> EffortModel:
        """The same model calibrating its thresholds on ``window`` (None: stored thresholds only)."""
        return dataclasses.replace(self, traffic=window)

    def reference_thresholds(self, shares: Sequence[float]) -> tuple[float, ...]:
        if len(self.score_quantiles) < 2:
            raise ClassifierError(f"model {self.version} has no stored score quantiles; retrain to change its mix")
        grid = np.linspace(0.0, 1.0, len(self.score_quantiles))
        cuts = np.interp(np.cumsum(np.asarray(shares, dtype=float))[:-1] / float(np.sum(shares)), grid,
                         np.asarray(self.score_quantiles))
        cuts = np.maximum.accumulate(np.nextafter(cuts, np.inf))
        for i in range(1, len(cuts)):
            if cuts[i] <= cuts[i - 1]:
                cuts[i] = np.nextafter(cuts[i - 1], np.inf)
        return tuple(float(c) for c in cuts)

    def current_thresholds(self) -> tuple[float, ...]:
        """The thresholds the next decision uses: the traffic window's once warm, else the stored ones."""
        live = self.traffic.thresholds(self.tier_shares) if self.traffic is not None else None
        return live if live is not None else self.thresholds

    # -- single prompt (request path) ------------------------------------------------
    def decide(self, messages: Sequence[Message] | str, tenant: str | None = None) -> EffortDecision:
        """The decision for a conversation (OpenAI messages; a plain string is one user turn)."""
        idx, val = extract_arrays(user_prompt(messages) if isinstance(messages, str) else messages)
        return self.decide_arrays(idx, val, tenant)

    def decide_features(self, features: SparseFeatures, tenant: str | None = None) -> EffortDecision:
        if features.feature_version != self.feature_version:
            raise ClassifierError(f"features are version {features.feature_version}, model expects "
                                  f"{self.feature_version}")
        idx, val = to_arrays(features)
        return self.decide_arrays(idx, val, tenant)

    def score_features(self, features: SparseFeatures, tenant: str | None = None) -> float:
        """The score alone (no tier, the traffic window untouched): for evaluation and learning."""
        idx, val = to_arrays(features)
        return _squash_scalar(self.raw_score(idx, val, tenant))

    def raw_score(self, idx: np.ndarray, val: np.ndarray, tenant: str | None = None) -> float:
        raw = float(val @ self.score_coef[idx]) + self.score_intercept
        correction = self.tenants.get(tenant) if tenant is not None else None
        return raw + correction(idx, val) if correction is not None else raw

    def decide_arrays(self, idx: np.ndarray, val: np.ndarray, tenant: str | None) -> EffortDecision:
        raw = self.raw_score(idx, val, tenant)
        if self.ordinal_cuts:
            probs: Sequence[float] = _ordinal_scalar(raw, self.ordinal_slope, self.ordinal_cuts,
                                                     self.ordinal_smoothing)
        else:
            logits = val @ self.tier_coef[idx] + self.tier_intercept
            probs = _softmax(logits[None, :] / self.temperature)[0]
        score = _squash_scalar(raw)
        decision = self._decision(score, probs, self.current_thresholds())
        if self.traffic is not None:
            self.traffic.add(score)
        return decision

    def _decision(self, score: float, probs: Sequence[float], thresholds: Sequence[float]) -> EffortDecision:
        full = dict.fromkeys(TIERS, 0.0)
        for cls, p in zip(self.classes, probs, strict=True):
            full[cls] = float(p)
        tier = TIERS[bisect.bisect_right(thresholds, score)]
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

    def scores_matrix(self, X: sp.csr_matrix) -> np.ndarray:
        """Scores (n,) of a feature matrix (no tenant corrections; the traffic window is untouched)."""
        return np.asarray(squash_score(np.asarray(X @ self.score_coef).ravel() + self.score_intercept))

    def decisions_matrix(self, X: sp.csr_matrix) -> list[EffortDecision]:
        """Decisions with the stored thresholds (the traffic window is neither read nor fed)."""
        probs, scores = self.predict_matrix(X)
        return [self._decision(float(s), p, self.thresholds) for s, p in zip(scores, probs, strict=True)]

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


def _squash_scalar(raw: float) -> float:
    z = -SCORE_SLOPE * (raw - 0.5)
    return 0.0 if z > 700 else 1.0 / (1.0 + math.exp(z))


def _expit(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def _ordinal_scalar(raw: float, slope: float, cuts: Sequence[float], smoothing: float) -> list[float]:
    """classifier.ordinal.ordinal_probs for one score, in plain Python (the request path)."""
    cdf = [0.0, *(_expit(c - slope * raw) for c in cuts), 1.0]
    p = [min(max(b - a, 1e-9), 1.0) for a, b in itertools.pairwise(cdf)]
    total = sum(p)
    k = len(p)
    return [(1.0 - smoothing) * x / total + smoothing / k for x in p]


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


__all__ = ["DENSE_NAMES", "SCORE_SLOPE", "SINGLE_TIER_BANDS", "Contribution", "EffortModel", "TenantCorrection",
           "squash_score"]
