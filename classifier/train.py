"""Training: features → scikit-learn heads → an EffortModel, with grouped-by-source CV.

``train`` fits a multinomial logistic regression over the tiers and a ridge regression
for the continuous score, calibrates a temperature on out-of-fold logits (GroupKFold by
source, so calibration and the reported metrics measure unseen *kinds* of prompt), and
calibrates the band thresholds to the target mix. Sources are re-weighted by
1/sqrt(size) so that the biggest sources do not decide everything.

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.stats import spearmanr
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.model_selection import GroupKFold

from classifier.calibrate import (
    DEFAULT_TARGET_MIX,
    bands_from_mix,
    calibrate_thresholds,
    expected_calibration_error,
    fit_temperature,
)
from classifier.data import dataset_hash
from classifier.evaluate import auroc
from classifier.features import FEATURE_VERSION, N_FEATURES, extract
from classifier.model import EffortModel, squash_score
from classifier.types import TIER_INDEX, TIERS, ClassifierError, FeatureVersionError, LabelledExample

N_QUANTILES = 1001


@dataclass(frozen=True)
class TrainConfig:
    c: float = 4.0  # inverse L2 strength of the tier head
    ridge_alpha: float = 3.0
    max_iter: int = 100
    tol: float = 1e-3
    cv_folds: int = 5
    target_mix: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TARGET_MIX))


@dataclass(frozen=True)
class TierMetrics:
    tier: str
    support: int
    precision: float
    recall: float


@dataclass(frozen=True)
class CVReport:
    """Grouped-by-source cross-validation of the tier head and the score."""

    folds: int
    per_tier: tuple[TierMetrics, ...]
    auroc_needs_medium: float
    ece_before: float
    ece_after: float
    temperature: float
    accuracy: float
    within_source: dict[str, float] = field(default_factory=dict)  # Spearman(OOF score, target) per source

    def to_json(self) -> dict[str, Any]:
        return {"folds": self.folds, "auroc_needs_medium": self.auroc_needs_medium,
                "ece_uncalibrated": self.ece_before, "ece_calibrated": self.ece_after,
                "temperature": self.temperature, "accuracy": self.accuracy,
                "within_source_spearman": self.within_source,
                "per_tier": {m.tier: {"support": m.support, "precision": m.precision, "recall": m.recall}
                             for m in self.per_tier}}


@dataclass(frozen=True)
class TrainResult:
    model: EffortModel
    data_hash: str
    n_examples: int
    cv: CVReport | None
    seconds: float


def featurize(examples: Sequence[LabelledExample]) -> sp.csr_matrix:
    """The (n, N_FEATURES) feature matrix; stored features must match FEATURE_VERSION."""
    indptr: list[int] = [0]
    indices: list[int] = []
    values: list[float] = []
    for ex in examples:
        f = ex.features if ex.features is not None else extract(ex.messages or [])
        if f.feature_version != FEATURE_VERSION:
            raise FeatureVersionError(f"stored features have version {f.feature_version}; this "
                                      f"classifier computes {FEATURE_VERSION}")
        indices.extend(f.indices)
        values.extend(f.values)
        indptr.append(len(indices))
    return sp.csr_matrix((np.asarray(values, dtype=np.float32), np.asarray(indices, dtype=np.int64),
                          np.asarray(indptr, dtype=np.int64)), shape=(len(examples), N_FEATURES))


def sample_weights(examples: Sequence[LabelledExample]) -> np.ndarray:
    """Per-example weight: the example's own weight × 1/sqrt(size of its source), mean 1."""
    sizes = Counter(ex.source for ex in examples)
    w = np.asarray([ex.weight / np.sqrt(sizes[ex.source]) for ex in examples], dtype=float)
    return w * (len(w) / w.sum())


@dataclass(frozen=True, eq=False)
class _Heads:
    """Both fitted heads, expanded back to all N_FEATURES columns."""

    tier_coef: np.ndarray  # (N_FEATURES, n_classes)
    tier_intercept: np.ndarray  # (n_classes,)
    score_coef: np.ndarray  # (N_FEATURES,)
    score_intercept: float

    def logits(self, X: sp.csr_matrix) -> np.ndarray:
        return np.asarray(X @ self.tier_coef) + self.tier_intercept

    def scores(self, X: sp.csr_matrix) -> np.ndarray:
        return np.asarray(squash_score(np.asarray(X @ self.score_coef).ravel() + self.score_intercept))


def _fit_heads(X: sp.csr_matrix, y: np.ndarray, s: np.ndarray, w: np.ndarray, n_classes: int,
               cfg: TrainConfig) -> _Heads:
    """Fit on the columns the data uses (hashing leaves most empty), then expand back."""
    cols = np.unique(X.indices)
    Xc = X[:, cols]
    clf = LogisticRegression(C=cfg.c, solver="saga", max_iter=cfg.max_iter, tol=cfg.tol, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(Xc, y, sample_weight=w)
    reg = Ridge(alpha=cfg.ridge_alpha, solver="sparse_cg")
    reg.fit(Xc, s, sample_weight=w)
    tier_coef = np.zeros((N_FEATURES, n_classes), dtype=np.float32)
    tier_intercept = np.full(n_classes, -30.0, dtype=np.float32)  # classes absent from this fit
    present = clf.classes_.astype(int)
    if len(present) == 2:  # sklearn keeps one column for two classes: split it symmetrically
        tier_coef[np.ix_(cols, present)] = np.stack([-clf.coef_[0] / 2, clf.coef_[0] / 2], axis=1)
        tier_intercept[present] = [-clf.intercept_[0] / 2, clf.intercept_[0] / 2]
    else:
        tier_coef[np.ix_(cols, present)] = clf.coef_.T
        tier_intercept[present] = clf.intercept_
    score_coef = np.zeros(N_FEATURES, dtype=np.float32)
    score_coef[cols] = reg.coef_
    return _Heads(tier_coef, tier_intercept, score_coef, float(reg.intercept_))


def cross_validate(examples: Sequence[LabelledExample], X: sp.csr_matrix, cfg: TrainConfig
                   ) -> tuple[CVReport, np.ndarray]:
    """Grouped-by-source CV; returns the report and the out-of-fold scores."""
    classes = sorted({TIER_INDEX[ex.tier] for ex in examples})
    y = np.asarray([classes.index(TIER_INDEX[ex.tier]) for ex in examples])
    s = np.asarray([ex.score for ex in examples])
    w = sample_weights(examples)
    groups = np.asarray([ex.source for ex in examples])
    n_groups = len(set(groups.tolist()))
    folds = min(cfg.cv_folds, n_groups)
    if folds < 2:
        raise ClassifierError("grouped cross-validation needs examples from at least two sources")
    oof_logits = np.zeros((len(y), len(classes)))
    oof_scores = np.zeros(len(y))
    for train_idx, test_idx in GroupKFold(n_splits=folds).split(X, y, groups):
        heads = _fit_heads(X[train_idx], y[train_idx], s[train_idx], w[train_idx], len(classes), cfg)
        oof_logits[test_idx] = heads.logits(X[test_idx])
        oof_scores[test_idx] = heads.scores(X[test_idx])
    temperature = fit_temperature(oof_logits, y, w)
    p_before = _softmax(oof_logits)
    p_after = _softmax(oof_logits / temperature)
    pred = p_after.argmax(axis=1)
    per_tier = []
    for k, cls in enumerate(classes):
        tp = int(((pred == k) & (y == k)).sum())
        per_tier.append(TierMetrics(TIERS[cls], int((y == k).sum()),
                                    tp / max(int((pred == k).sum()), 1), tp / max(int((y == k).sum()), 1)))
    needs = np.asarray([TIER_INDEX[ex.tier] >= TIER_INDEX["medium"] for ex in examples])
    report = CVReport(folds=folds, per_tier=tuple(per_tier), auroc_needs_medium=auroc(oof_scores, needs),
                      ece_before=expected_calibration_error(p_before, y),
                      ece_after=expected_calibration_error(p_after, y), temperature=temperature,
                      accuracy=float((pred == y).mean()), within_source=_within_source(groups, oof_scores, s))
    return report, oof_scores


def _within_source(groups: np.ndarray, scores: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Rank correlation of held-out scores with the targets inside each source that has
    graded difficulty: can the model order prompts of a kind it never trained on?"""
    out = {}
    for g in sorted(set(groups.tolist())):
        m = groups == g
        if m.sum() >= 20 and len(np.unique(targets[m])) > 1:
            out[g] = float(spearmanr(scores[m], targets[m]).statistic)
    return out


def train(examples: Sequence[LabelledExample], cfg: TrainConfig | None = None, *, cv: bool = True,
          version: str = "unversioned", temperature: float | None = None) -> TrainResult:
    """Fit both heads on ``examples``; with ``cv`` also calibrate and measure out of fold.
    Without ``cv`` the tier head keeps ``temperature`` (e.g. the previous version's; default 1)."""
    cfg = cfg or TrainConfig()
    t0 = time.perf_counter()
    if len({ex.tier for ex in examples}) < 2:
        raise ClassifierError("training needs at least two different tiers")
    X = featurize(examples)
    classes = sorted({TIER_INDEX[ex.tier] for ex in examples})
    y = np.asarray([classes.index(TIER_INDEX[ex.tier]) for ex in examples])
    s = np.asarray([ex.score for ex in examples])
    w = sample_weights(examples)
    report: CVReport | None = None
    if cv:
        report, _ = cross_validate(examples, X, cfg)
    heads = _fit_heads(X, y, s, w, len(classes), cfg)
    scores = heads.scores(X)
    bands, shares = bands_from_mix(cfg.target_mix)
    thresholds = calibrate_thresholds(scores, shares)  # the training distribution hits the mix
    model = EffortModel(
        classes=tuple(TIERS[c] for c in classes), tier_coef=heads.tier_coef, tier_intercept=heads.tier_intercept,
        temperature=report.temperature if report is not None else (temperature or 1.0),
        score_coef=heads.score_coef, score_intercept=heads.score_intercept,
        thresholds=thresholds, bands=bands, version=version,
        score_quantiles=tuple(float(q) for q in np.quantile(scores, np.linspace(0.0, 1.0, N_QUANTILES))))
    return TrainResult(model=model, data_hash=dataset_hash(list(examples)), n_examples=len(examples), cv=report,
                       seconds=time.perf_counter() - t0)


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)
