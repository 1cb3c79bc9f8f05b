"""Training: features → scikit-learn heads → an EffortModel, with grouped-by-source CV.

``train`` fits the continuous score as two ridge heads on the same features, summed into
one coefficient vector: a cross-family head (the score targets across sources) plus
``within_weight`` × a within-family head (family indicators absorb each family's level, so
its weights learn difficulty *inside* a kind of prompt, which transfers to unseen kinds).
Tier probabilities come from an ordinal model on that score (classifier.ordinal), fitted
on out-of-fold scores of GroupKFold by source family, so calibration and the reported
metrics (including the proxy routing APGR of classifier.proxy) measure unseen *kinds* of
prompt. A multinomial tier head with a temperature is still fitted and reported for
comparison. Band thresholds hit the target mix. Sources are re-weighted by 1/sqrt(size) so
that the biggest sources do not decide everything.

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
from classifier.features import DENSE_NAMES, FEATURE_VERSION, N_DENSE, N_FEATURES, extract
from classifier.model import EffortModel, squash_score
from classifier.ordinal import SMOOTHING_GRID, fit_ordinal, log_loss, ordinal_probs
from classifier.proxy import family, proxy_apgr, proxy_oracle
from classifier.types import TIER_INDEX, TIERS, ClassifierError, FeatureVersionError, LabelledExample

N_QUANTILES = 1001
FAMILY_SCALE = 10.0  # family indicators ×10 → their ridge penalty is 1/100 of a feature's
WITHIN_GRID = (0.0, 1.0, 2.0, 3.0, 4.0)


@dataclass(frozen=True)
class TrainConfig:
    c: float = 4.0  # inverse L2 strength of the tier head
    ridge_alpha: float = 3.0
    max_iter: int = 100
    tol: float = 1e-3
    cv_folds: int = 5
    # Weight of the within-family head added to the cross-family score (see _fit_within);
    # chosen by `tiergate classifier cv`'s proxy APGR over WITHIN_GRID.
    within_weight: float = 3.0
    within_alpha: float = 30.0  # the within-family head is regularised harder: n-grams overfit a family
    # Size features the cross-family head may not use: across families, length mostly tells the
    # source apart (NQ short, olympiads long); the within-family head still learns what length
    # means inside a kind of prompt.
    cross_excluded: tuple[str, ...] = ("log_chars", "log_words", "sentences", "newlines")
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
    proxy_apgr: dict[str, float] = field(default_factory=dict)  # held-out family → APGR (classifier.proxy)
    log_loss: float = float("nan")  # held-out NLL of the reported tier probabilities
    prob_model: str = "temperature"  # what produced the reported probabilities
    log_loss_temperature: float = float("nan")  # the same for the temperature-scaled tier head
    ece_uncalibrated: float = float("nan")  # the tier head's softmax before temperature scaling
    within_grid: dict[str, float] = field(default_factory=dict)  # within_weight → mean proxy APGR
    ordinal_slope: float = 0.0  # the ordinal model fitted on all held-out scores (shipped)
    ordinal_cuts: tuple[float, ...] = ()
    ordinal_smoothing: float = 0.0
    proxy_oracle_mean: float = float("nan")  # the proxy's ceiling (random = 0.5)

    @property
    def proxy_apgr_mean(self) -> float:
        return float(np.mean(list(self.proxy_apgr.values()))) if self.proxy_apgr else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {"folds": self.folds, "auroc_needs_medium": self.auroc_needs_medium,
                "ece_uncalibrated": self.ece_before, "ece_calibrated": self.ece_after,
                "temperature": self.temperature, "accuracy": self.accuracy,
                "within_source_spearman": self.within_source,
                "proxy_apgr": self.proxy_apgr, "proxy_apgr_mean": self.proxy_apgr_mean,
                "proxy_apgr_oracle_mean": self.proxy_oracle_mean,
                "log_loss": self.log_loss, "prob_model": self.prob_model,
                "log_loss_temperature_head": self.log_loss_temperature, "ece_tier_head_raw": self.ece_uncalibrated,
                "proxy_apgr_by_within_weight": self.within_grid, "ordinal_smoothing": self.ordinal_smoothing,
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
    within_coef: np.ndarray  # (N_FEATURES,) within-family difficulty head
    within_offset: float  # its weighted mean on the training rows (subtracted: the head is centred)

    def logits(self, X: sp.csr_matrix) -> np.ndarray:
        return np.asarray(X @ self.tier_coef) + self.tier_intercept

    def raw(self, X: sp.csr_matrix, within_weight: float) -> np.ndarray:
        return (np.asarray(X @ self.score_coef).ravel() + self.score_intercept
                + within_weight * (np.asarray(X @ self.within_coef).ravel() - self.within_offset))


def _fit_within(Xc: sp.csr_matrix, s: np.ndarray, fams: np.ndarray, w: np.ndarray, cfg: TrainConfig) -> np.ndarray:
    """Ridge with one (almost unpenalised) indicator per family: the indicators absorb each
    family's mean difficulty, so the feature weights can only explain difficulty *inside* a
    family (MATH Level 1 vs 5, ARC-Easy vs Challenge, LeetCode Easy vs Hard) — cues that
    transfer to unseen kinds of prompt instead of recognising the source."""
    _, codes = np.unique(fams, return_inverse=True)
    n = Xc.shape[0]
    # Feedback rows get no indicator (and there is no free intercept): what the reviews say
    # must move the feature weights.
    scale = np.where(fams == "feedback", 0.0, FAMILY_SCALE)
    dummies = sp.csr_matrix((scale, (np.arange(n), codes)), shape=(n, int(codes.max()) + 1))
    reg = Ridge(alpha=cfg.within_alpha, solver="sparse_cg", fit_intercept=False)
    reg.fit(sp.hstack([Xc, dummies]).tocsr(), s, sample_weight=w)
    return np.asarray(reg.coef_[:Xc.shape[1]])


def _fit_heads(X: sp.csr_matrix, y: np.ndarray, s: np.ndarray, w: np.ndarray, fams: np.ndarray, n_classes: int,
               cfg: TrainConfig) -> _Heads:
    """Fit on the columns the data uses (hashing leaves most empty), then expand back."""
    cols = np.unique(X.indices)
    Xc = X[:, cols]
    clf = LogisticRegression(C=cfg.c, solver="saga", max_iter=cfg.max_iter, tol=cfg.tol, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(Xc, y, sample_weight=w)
    reg = Ridge(alpha=cfg.ridge_alpha, solver="sparse_cg")
    keep = np.asarray([not (c < N_DENSE and DENSE_NAMES[c] in cfg.cross_excluded) for c in cols])
    reg.fit(Xc[:, np.flatnonzero(keep)], s, sample_weight=w)
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
    score_coef[cols[keep]] = reg.coef_
    within_coef = np.zeros(N_FEATURES, dtype=np.float32)
    within_coef[cols] = _fit_within(Xc, s, fams, w, cfg)
    offset = float(np.average(np.asarray(Xc @ within_coef[cols]).ravel(), weights=w))
    return _Heads(tier_coef, tier_intercept, score_coef, float(reg.intercept_), within_coef, offset)


def cross_validate(examples: Sequence[LabelledExample], X: sp.csr_matrix, cfg: TrainConfig
                   ) -> tuple[CVReport, np.ndarray]:
    """Grouped-by-source CV; returns the report and the out-of-fold scores."""
    classes = sorted({TIER_INDEX[ex.tier] for ex in examples})
    y = np.asarray([classes.index(TIER_INDEX[ex.tier]) for ex in examples])
    s = np.asarray([ex.score for ex in examples])
    w = sample_weights(examples)
    groups = np.asarray([family(ex.source) for ex in examples])
    n_groups = len(set(groups.tolist()))
    folds = min(cfg.cv_folds, n_groups)
    if folds < 2:
        raise ClassifierError("grouped cross-validation needs examples from at least two sources")
    oof_logits = np.zeros((len(y), len(classes)))
    oof_cross, oof_within = np.zeros(len(y)), np.zeros(len(y))
    fold_of = np.zeros(len(y), dtype=np.int64)
    for k, (train_idx, test_idx) in enumerate(GroupKFold(n_splits=folds).split(X, y, groups)):
        heads = _fit_heads(X[train_idx], y[train_idx], s[train_idx], w[train_idx], groups[train_idx],
                           len(classes), cfg)
        oof_logits[test_idx] = heads.logits(X[test_idx])
        oof_cross[test_idx] = heads.raw(X[test_idx], 0.0)
        oof_within[test_idx] = np.asarray(X[test_idx] @ heads.within_coef).ravel() - heads.within_offset
        fold_of[test_idx] = k
    blend = {lam: proxy_apgr(examples, oof_cross + lam * oof_within) for lam in WITHIN_GRID}
    oof_raw = oof_cross + cfg.within_weight * oof_within
    oof_scores = np.asarray(squash_score(oof_raw))
    # Ordinal probabilities, cross-fitted: each fold's are fitted on the other folds' held-out scores.
    # The uniform share mixed in is the one scalar chosen on these cross-fitted probabilities.
    p_ord = np.zeros((len(y), len(classes)))
    for k in range(folds):
        m = fold_of == k
        slope, cuts = fit_ordinal(oof_raw[~m], y[~m], len(classes), w[~m])
        p_ord[m] = ordinal_probs(oof_raw[m], slope, np.asarray(cuts))
    smoothing = min(SMOOTHING_GRID, key=lambda e: log_loss((1 - e) * p_ord + e / len(classes), y, w))
    p_ord = (1 - smoothing) * p_ord + smoothing / len(classes)
    slope, cuts = fit_ordinal(oof_raw, y, len(classes), w)
    temperature = fit_temperature(oof_logits, y, w)
    p_before = _softmax(oof_logits)
    p_temp = _softmax(oof_logits / temperature)
    p_after = p_ord
    pred = p_after.argmax(axis=1)
    per_tier = []
    for k, cls in enumerate(classes):
        tp = int(((pred == k) & (y == k)).sum())
        per_tier.append(TierMetrics(TIERS[cls], int((y == k).sum()),
                                    tp / max(int((pred == k).sum()), 1), tp / max(int((y == k).sum()), 1)))
    needs = np.asarray([TIER_INDEX[ex.tier] >= TIER_INDEX["medium"] for ex in examples])
    report = CVReport(folds=folds, per_tier=tuple(per_tier), auroc_needs_medium=auroc(oof_scores, needs),
                      ece_before=expected_calibration_error(p_temp, y),
                      ece_after=expected_calibration_error(p_after, y), temperature=temperature,
                      accuracy=float((pred == y).mean()), within_source=_within_source(groups, oof_scores, s),
                      proxy_apgr=proxy_apgr(examples, oof_scores), log_loss=log_loss(p_after, y, w),
                      prob_model="ordinal on the score", log_loss_temperature=log_loss(p_temp, y, w),
                      ece_uncalibrated=expected_calibration_error(p_before, y),
                      within_grid={str(k): float(np.mean(list(v.values()))) for k, v in blend.items()},
                      ordinal_slope=slope, ordinal_cuts=cuts, ordinal_smoothing=smoothing,
                      proxy_oracle_mean=float(np.mean(list(proxy_oracle(examples).values()) or [np.nan])))
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
          version: str = "unversioned", temperature: float | None = None,
          ordinal: Sequence[Any] | None = None) -> TrainResult:
    """Fit the heads on ``examples``; with ``cv`` also calibrate and measure out of fold.
    Without ``cv`` the tier head keeps ``temperature`` (e.g. the previous version's; default 1)
    and the ordinal probabilities keep ``ordinal`` = (slope, cuts[, smoothing]) when it fits the classes,
    else they are fitted on the training scores (over-confident: prefer a CV run)."""
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
    fams = np.asarray([family(ex.source) for ex in examples])
    heads = _fit_heads(X, y, s, w, fams, len(classes), cfg)
    raw = heads.raw(X, cfg.within_weight)
    scores = np.asarray(squash_score(raw))
    smoothing = 0.0
    if report is not None:
        slope, cuts, smoothing = report.ordinal_slope, tuple(report.ordinal_cuts), report.ordinal_smoothing
    elif ordinal is not None and len(ordinal[1]) == len(classes) - 1:
        slope, cuts = float(ordinal[0]), tuple(float(c) for c in ordinal[1])
        smoothing = float(ordinal[2]) if len(ordinal) > 2 else 0.0
    else:
        slope, cuts = fit_ordinal(raw, y, len(classes), w)
    bands, shares = bands_from_mix(cfg.target_mix)
    thresholds = calibrate_thresholds(scores, shares)  # the training distribution hits the mix
    model = EffortModel(
        classes=tuple(TIERS[c] for c in classes), tier_coef=heads.tier_coef, tier_intercept=heads.tier_intercept,
        temperature=report.temperature if report is not None else (temperature or 1.0),
        score_coef=(heads.score_coef + cfg.within_weight * heads.within_coef).astype(np.float32),
        score_intercept=heads.score_intercept - cfg.within_weight * heads.within_offset,
        thresholds=thresholds, bands=bands, version=version,
        ordinal_slope=slope, ordinal_cuts=cuts, ordinal_smoothing=smoothing,
        score_quantiles=tuple(float(q) for q in np.quantile(scores, np.linspace(0.0, 1.0, N_QUANTILES))))
    return TrainResult(model=model, data_hash=dataset_hash(list(examples)), n_examples=len(examples), cv=report,
                       seconds=time.perf_counter() - t0)


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)
