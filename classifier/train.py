"""Training: features → scikit-learn heads → an EffortModel, with grouped-by-source CV.

``train`` fits the continuous score as two ridge heads on the same features, summed into
one coefficient vector: a cross-family head (the score targets across sources) plus
``within_weight`` × a within-family head (family indicators absorb each family's level, so
its weights learn difficulty *inside* a kind of prompt, which transfers to unseen kinds).
Outcome sets (classifier.payoff: per-prompt outcomes of a cheap and a strong arm) are trained
together with the source labels as one more family each, so the same weights must also say
where extra reasoning paid. Tier probabilities come from an ordinal model on that score
(classifier.ordinal), fitted on out-of-fold scores of GroupKFold by source family, so
calibration and the reported metrics (including the proxy routing APGR of classifier.proxy)
measure unseen *kinds* of prompt; an outcome set is reported with whole groups (tasks) held
out. A multinomial tier head with a temperature is still fitted and reported for comparison.
Thresholds hit the target mix on a family-balanced reference distribution (live traffic
recalibrates them: classifier.thresholds). Sources are re-weighted by 1/sqrt(size).

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.stats import spearmanr
from sklearn.model_selection import GroupKFold

from classifier.calibrate import expected_calibration_error, fit_temperature
from classifier.data import dataset_hash
from classifier.evaluate import auroc, metrics, routing_curve
from classifier.gain import GainHead
from classifier.heads import TrainConfig, TrainingRows, featurize, fit_heads, sample_weights, softmax
from classifier.model import EffortModel, squash_score
from classifier.ordinal import SMOOTHING_GRID, fit_ordinal, log_loss, ordinal_probs
from classifier.outcomes import CHEAP_ARM, STRONG_ARM, OutcomeItem
from classifier.payoff import group_folds, grouped_outcome_scores, outcome_rows, scale_weights, with_gain_head
from classifier.proxy import cheap_outcome, family, proxy_apgr, proxy_oracle
from classifier.thresholds import full_mix
from classifier.types import TIER_INDEX, TIERS, ClassifierError, LabelledExample

N_QUANTILES = 1001
WITHIN_GRID = (0.0, 1.0, 2.0, 3.0, 4.0)

__all__ = ["N_QUANTILES", "WITHIN_GRID", "CVReport", "OutcomeCV", "TierMetrics", "TrainConfig", "TrainResult",
           "cross_validate", "featurize", "fit_score_model", "outcome_cross_validate", "outcome_training_rows",
           "reference_quantiles", "sample_weights", "source_rows", "train"]


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
    # proxy APGR pooled over the synthetic conversations (classifier.augment), by kind
    augmented_apgr: dict[str, float] = field(default_factory=dict)

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
                "augmented_proxy_apgr": self.augmented_apgr,
                "per_tier": {m.tier: {"support": m.support, "precision": m.precision, "recall": m.recall}
                             for m in self.per_tier}}


@dataclass(frozen=True)
class OutcomeCV:
    """An outcome set's routing metrics with whole groups held out (models that never saw them)."""

    name: str
    n_items: int
    n_groups: int
    folds: int
    apgr: float
    cpt50: float
    cpt80: float
    length_apgr: float  # the prompt-length router on the same items
    scores: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    # PGR of the held-out scores at strong shares 0, 0.1, ..., 1 (what a quality target aims on)
    pgr_at_shares: tuple[float, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"items": self.n_items, "groups": self.n_groups, "folds": self.folds, "apgr": self.apgr,
                "cpt50": self.cpt50, "cpt80": self.cpt80, "length_apgr": self.length_apgr}


@dataclass(frozen=True)
class TrainResult:
    model: EffortModel
    data_hash: str
    n_examples: int
    cv: CVReport | None
    seconds: float
    outcome_cv: dict[str, OutcomeCV] = field(default_factory=dict)
    n_outcome_rows: int = 0
    gain: dict[str, Any] | None = None  # the gain head's summary (gain_summary), None without one


def gain_summary(head: GainHead | None, scale: float, cfg: TrainConfig) -> dict[str, Any] | None:
    """What the artifact's metadata says of the gain head: data, chosen L2 strength, scale, weight."""
    if head is None:
        return None
    return {"rows": head.n_rows, "groups": head.n_groups, "alpha": head.alpha, "scale": round(scale, 6),
            "weight": cfg.gain_weight, "inner_logo_apgr": {str(a): round(v, 4) for a, v in head.inner_apgr.items()}}


def source_rows(examples: Sequence[LabelledExample], X: sp.csr_matrix | None = None) -> TrainingRows:
    """The labelled examples as training rows (tier index over the tiers present)."""
    classes = sorted({TIER_INDEX[ex.tier] for ex in examples})
    return TrainingRows(X if X is not None else featurize(examples),
                        np.asarray([classes.index(TIER_INDEX[ex.tier]) for ex in examples], dtype=np.int64),
                        np.asarray([ex.score for ex in examples], dtype=float), sample_weights(examples),
                        np.asarray([family(ex.source) for ex in examples], dtype=object))


def outcome_training_rows(outcomes: Mapping[str, Sequence[OutcomeItem]], cfg: TrainConfig,
                           source_total: float) -> TrainingRows | None:
    if not outcomes:
        return None
    rows = outcome_rows(outcomes, cfg)
    return scale_weights(rows, source_total, cfg.outcome_share) if len(rows) else None


def cross_validate(examples: Sequence[LabelledExample], X: sp.csr_matrix, cfg: TrainConfig,
                   extra: TrainingRows | None = None,
                   gain_rows: TrainingRows | None = None) -> tuple[CVReport, np.ndarray]:
    """Grouped-by-source CV; returns the report and the out-of-fold scores. ``extra`` rows (outcome
    sets, already weighted) are in every fold's training data and never scored; ``gain_rows``
    (unweighted outcome rows) train the gain head that every fold's score gets, as the model's does."""
    head = None
    if gain_rows is not None and len(gain_rows) and cfg.gain_weight > 0:
        _, _, head, _ = with_gain_head(np.zeros(X.shape[1], dtype=np.float32), 0.0, gain_rows, cfg)
    rows = source_rows(examples, X)
    classes = sorted({TIER_INDEX[ex.tier] for ex in examples})
    y, s, w, groups = rows.y, rows.s, rows.w, rows.fams
    n_groups = len(set(groups.tolist()))
    folds = min(cfg.cv_folds, n_groups)
    if folds < 2:
        raise ClassifierError("grouped cross-validation needs examples from at least two sources")
    oof_logits = np.zeros((len(y), len(classes)))
    oof_cross, oof_within, oof_gain = np.zeros(len(y)), np.zeros(len(y)), np.zeros(len(y))
    fold_of = np.zeros(len(y), dtype=np.int64)
    for k, (train_idx, test_idx) in enumerate(GroupKFold(n_splits=folds).split(X, y, groups)):
        mask = np.zeros(len(y), dtype=bool)
        mask[train_idx] = True
        train_rows = TrainingRows.stack([rows.take(mask), *([extra] if extra is not None else [])])
        heads = fit_heads(train_rows, len(classes), cfg)
        oof_logits[test_idx] = heads.logits(X[test_idx])
        oof_cross[test_idx] = heads.raw(X[test_idx], 0.0)
        oof_within[test_idx] = np.asarray(X[test_idx] @ heads.within_coef).ravel() - heads.within_offset
        if head is not None:
            coef, intercept = heads.combined(cfg.within_weight)
            _, _, _, scale = with_gain_head(coef, intercept, gain_rows, cfg, head)
            oof_gain[test_idx] = scale * head.predict(X[test_idx])
        fold_of[test_idx] = k
    blend = {lam: proxy_apgr(examples, oof_cross + lam * oof_within + oof_gain) for lam in WITHIN_GRID}
    oof_raw = oof_cross + cfg.within_weight * oof_within + oof_gain
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
    p_before = softmax(oof_logits)
    p_temp = softmax(oof_logits / temperature)
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
                      proxy_oracle_mean=float(np.mean(list(proxy_oracle(examples).values()) or [np.nan])),
                      augmented_apgr=_augmented_apgr(examples, oof_scores))
    return report, oof_scores


def _augmented_apgr(examples: Sequence[LabelledExample], scores: np.ndarray) -> dict[str, float]:
    """Proxy APGR (synthetic outcomes from the tiers, classifier.proxy) of the held-out scores of the
    multi-turn and system-prompt variants, pooled over families."""
    out = {}
    for kind in ("multi_turn", "system"):
        m = np.asarray([ex.meta.get("augmented") == kind for ex in examples])
        cheap = np.asarray([cheap_outcome(ex.tier) for ex in examples])[m]
        if m.sum() >= 20 and len(np.unique(cheap)) > 1:
            out[kind] = metrics(scores[m], cheap, np.ones(int(m.sum()))).apgr
    return out


def outcome_cross_validate(examples: Sequence[LabelledExample], outcomes: Mapping[str, Sequence[OutcomeItem]],
                           cfg: TrainConfig, *, X: sp.csr_matrix | None = None, folds: int | None = None,
                           names: Sequence[str] | None = None, seed: int = 0) -> dict[str, OutcomeCV]:
    """Each outcome set's APGR with whole groups held out: ``folds`` grouped folds (None = one per
    group), every fold refitting the score on the source examples + all *other* outcome rows."""
    source = source_rows(examples, X)
    classes = len(set(source.y.tolist()))
    all_rows = outcome_rows(outcomes, cfg)
    out: dict[str, OutcomeCV] = {}
    for name in names or list(outcomes):
        mine = np.asarray([str(f) == f"outcome:{name}" for f in all_rows.fams])
        if not mine.any():
            continue
        groups = all_rows.groups[mine]
        test_folds = [np.where(mine, np.isin(all_rows.groups, groups[t]), False)
                      for t in group_folds(groups, folds, seed)]
        scores = grouped_outcome_scores(source, all_rows, cfg, classes, test_folds)[mine]
        items = [it for it in outcomes[name] if it.has(CHEAP_ARM, STRONG_ARM)]
        cheap = np.asarray([it.outcomes[CHEAP_ARM] for it in items])
        strong = np.asarray([it.outcomes[STRONG_ARM] for it in items])
        m = metrics(scores, cheap, strong)
        length = metrics(np.asarray([len(str(it.messages[-1].get("content", ""))) for it in items], dtype=float),
                         cheap, strong)
        curve = routing_curve(scores, cheap, strong)
        pgr = np.maximum.accumulate(np.clip(np.interp(QUALITY_SHARES, curve.shares, curve.pgr()), 0.0, 1.0))
        out[name] = OutcomeCV(name, len(items), len(set(groups.tolist())), len(test_folds), m.apgr, m.cpt50,
                              m.cpt80, length.apgr, scores, tuple(float(p) for p in pgr))
    return out


QUALITY_SHARES = np.linspace(0.0, 1.0, 11)


def quality_curve(per_set: Mapping[str, OutcomeCV]) -> dict[str, list[float]] | None:
    """(strong share → PGR) of the held-out scores, averaged over the outcome sets by size: the
    artifact's routing curve, which a quality target ("keep ≥ X of the all-strong quality") reads
    until the gateway's own learning publishes one measured on its traffic."""
    sets = [o for o in per_set.values() if len(o.pgr_at_shares) == len(QUALITY_SHARES)]
    if not sets:
        return None
    pgr = np.average([o.pgr_at_shares for o in sets], axis=0, weights=[o.n_items for o in sets])
    return {"shares": [float(q) for q in QUALITY_SHARES], "pgr": [round(float(p), 4) for p in pgr]}


def _within_source(groups: np.ndarray, scores: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Rank correlation of held-out scores with the targets inside each source that has
    graded difficulty: can the model order prompts of a kind it never trained on?"""
    out = {}
    for g in sorted(set(groups.tolist())):
        m = groups == g
        if m.sum() >= 20 and len(np.unique(targets[m])) > 1:
            out[g] = float(spearmanr(scores[m], targets[m]).statistic)
    return out


def reference_quantiles(scores: np.ndarray, fams: np.ndarray) -> tuple[float, ...]:
    """Score quantiles of a family-balanced mix (every family the same total weight): the stored
    thresholds' reference, closer to mixed traffic than the raw training distribution. Feedback
    rows (what reviews said about past traffic) count with the family of the data they resemble,
    i.e. as training rows only, not as a family of their own."""
    keep = fams != "feedback"
    if keep.any():
        scores, fams = scores[keep], fams[keep]
    counts = Counter(fams.tolist())
    w = np.asarray([1.0 / counts[f] for f in fams.tolist()])
    order = np.argsort(scores, kind="stable")
    cdf = np.cumsum(w[order]) / w.sum()
    grid = np.linspace(0.0, 1.0, N_QUANTILES)
    return tuple(float(scores[order][min(int(np.searchsorted(cdf, q)), len(order) - 1)]) for q in grid)


def train(examples: Sequence[LabelledExample], cfg: TrainConfig | None = None, *, cv: bool = True,
          version: str = "unversioned", temperature: float | None = None,
          ordinal: Sequence[Any] | None = None, outcomes: Mapping[str, Sequence[OutcomeItem]] | None = None,
          outcome_cv: bool = False) -> TrainResult:
    """Fit the heads on ``examples`` (+ the ``outcomes`` sets, see classifier.payoff); with ``cv``
    also calibrate and measure out of fold, with ``outcome_cv`` report each outcome set with whole
    groups held out. Without ``cv`` the tier head keeps ``temperature`` (e.g. the previous
    version's; default 1) and the ordinal probabilities keep ``ordinal`` = (slope, cuts[, smoothing])
    when it fits the classes, else they are fitted on the training scores (over-confident: prefer a CV run)."""
    cfg = cfg or TrainConfig()
    t0 = time.perf_counter()
    if len({ex.tier for ex in examples}) < 2:
        raise ClassifierError("training needs at least two different tiers")
    X = featurize(examples)
    source = source_rows(examples, X)
    classes = sorted({TIER_INDEX[ex.tier] for ex in examples})
    extra = outcome_training_rows(outcomes or {}, cfg, float(source.w.sum()))
    report: CVReport | None = None
    gain_rows = outcome_rows(outcomes, cfg) if outcomes else None
    if cv:
        report, _ = cross_validate(examples, X, cfg, extra, gain_rows)
    per_set = outcome_cross_validate(examples, outcomes, cfg, X=X, folds=cfg.outcome_folds) \
        if outcome_cv and outcomes else {}
    all_rows = TrainingRows.stack([source, *([extra] if extra is not None else [])])
    heads = fit_heads(all_rows, len(classes), cfg)
    raw = heads.raw(X, cfg.within_weight)
    smoothing = 0.0
    if report is not None:
        slope, cuts, smoothing = report.ordinal_slope, tuple(report.ordinal_cuts), report.ordinal_smoothing
    elif ordinal is not None and len(ordinal[1]) == len(classes) - 1:
        slope, cuts = float(ordinal[0]), tuple(float(c) for c in ordinal[1])
        smoothing = float(ordinal[2]) if len(ordinal) > 2 else 0.0
    else:
        slope, cuts = fit_ordinal(raw, source.y, len(classes), source.w)
    coef, intercept = heads.combined(cfg.within_weight)
    coef, intercept, gain_head, gain_scale = with_gain_head(coef, intercept, gain_rows, cfg)
    reference = TrainingRows.stack([all_rows, *([gain_rows] if gain_rows is not None and cfg.outcome_share <= 0
                                                 else [])])
    all_raw = np.asarray(reference.X @ coef).ravel() + intercept
    quantiles = reference_quantiles(np.asarray(squash_score(all_raw)), reference.fams)
    model = EffortModel(
        classes=tuple(TIERS[c] for c in classes), tier_coef=heads.tier_coef, tier_intercept=heads.tier_intercept,
        temperature=report.temperature if report is not None else (temperature or 1.0),
        score_coef=coef, score_intercept=intercept, thresholds=(0.0, 0.0, 0.0, 0.0, 0.0), version=version,
        ordinal_slope=slope, ordinal_cuts=cuts, ordinal_smoothing=smoothing, score_quantiles=quantiles,
        tier_shares=full_mix(cfg.target_mix)).with_target_mix(cfg.target_mix)
    return TrainResult(model=model, data_hash=dataset_hash(list(examples)), n_examples=len(examples), cv=report,
                       seconds=time.perf_counter() - t0, outcome_cv=per_set,
                       n_outcome_rows=len(gain_rows) if gain_rows is not None else 0,
                       gain=gain_summary(gain_head, gain_scale, cfg))


def fit_score_model(examples: Sequence[LabelledExample], outcomes: Mapping[str, Sequence[OutcomeItem]],
                    cfg: TrainConfig, like: EffortModel, version: str, X: sp.csr_matrix | None = None) -> EffortModel:
    """``like`` with its score refitted on ``examples`` + ``outcomes`` (score heads only, no CV: what a
    routing evaluation needs when ``like`` has seen the outcomes it is evaluated on)."""
    source = source_rows(examples, X)
    extra = outcome_training_rows(outcomes, cfg, float(source.w.sum()))
    rows = TrainingRows.stack([source, *([extra] if extra is not None else [])])
    heads = fit_heads(rows, len(set(source.y.tolist())), cfg, tier_head=False)
    coef, intercept = heads.combined(cfg.within_weight)
    gain_rows = outcome_rows(outcomes, cfg) if outcomes else None
    coef, intercept, _, _ = with_gain_head(coef, intercept, gain_rows, cfg)
    quantiles = reference_quantiles(np.asarray(squash_score(np.asarray(rows.X @ coef).ravel() + intercept)),
                                    rows.fams)
    return dataclasses.replace(like, score_coef=coef, score_intercept=intercept, score_quantiles=quantiles,
                               version=version, traffic=None).with_shares(like.tier_shares)
