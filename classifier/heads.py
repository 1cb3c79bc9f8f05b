"""The fitted heads of the effort model: the feature matrix, sample weights, and one fit of the
score heads (cross-family + within-family ridge) and the multinomial tier head.

``fit_heads`` is what training, grouped cross-validation and leave-groups-out routing
evaluation all call, so every reported number refits exactly the shipped procedure.

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression, Ridge

from classifier.features import DENSE_NAMES, FEATURE_VERSION, N_DENSE, N_FEATURES, extract_arrays
from classifier.thresholds import DEFAULT_TIER_MIX
from classifier.types import FeatureVersionError, LabelledExample, Message

FAMILY_SCALE = 10.0  # family indicators ×10 → their ridge penalty is 1/100 of a feature's


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
    # source apart (NQ short, olympiads long) and would send every short hard question to the
    # cheapest tiers; the within-family head still learns what length means inside a kind of prompt.
    cross_excluded: tuple[str, ...] = ("log_chars", "log_words", "sentences", "newlines", "short_prompt")
    target_mix: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_MIX))
    # The dense cues enter the ridge heads multiplied by this (their weights divided back on export):
    # a lighter penalty on the few general cues than on the 2^18 vocabulary columns, so that the
    # score leans on what transfers to unseen kinds of prompt (and to short prompts, which have few
    # n-grams) rather than on vocabulary that identifies a source.
    dense_scale: float = 1.0
    # Outcome rows (classifier.payoff) mixed into the ridge heads: their share of the total training
    # weight, and the score target centre + scale × (strong − cheap outcome). Off by default: the
    # outcome sets enter through the gain head instead (classifier.gain; measured better on held-out
    # tasks, and a held-out evaluation then refits only the small head per fold).
    outcome_share: float = 0.0
    outcome_center: float = 0.45
    outcome_scale: float = 0.35
    outcome_folds: int = 5  # grouped folds over an outcome set's groups for the reported held-out APGR
    # The gain head (classifier.gain): its weight against the source score (1.0 = equally spread on
    # the outcome rows); 0 turns it off. Rule: the largest of 1, 0.5, 0.25 that keeps the source
    # proxies' held-out mean within 0.01 of the score without the head — what BBH's "thinking pays"
    # learns conflicts in part with difficulty inside word problems, and both kinds are evaluated
    # (measured: README.md). Its L2 strength is picked from ``gain_alphas`` by leave-one-group-out
    # inside the training groups.
    gain_weight: float = 0.25
    gain_alphas: tuple[float, ...] = (100.0, 300.0, 1000.0, 3000.0, 10000.0)


def featurize_messages(conversations: Sequence[Sequence[Message]]) -> sp.csr_matrix:
    """The (n, N_FEATURES) feature matrix of conversations."""
    indptr: list[int] = [0]
    indices: list[int] = []
    values: list[float] = []
    for messages in conversations:
        idx, val = extract_arrays(messages)
        indices.extend(idx.tolist())
        values.extend(val.tolist())
        indptr.append(len(indices))
    return sp.csr_matrix((np.asarray(values, dtype=np.float32), np.asarray(indices, dtype=np.int64),
                          np.asarray(indptr, dtype=np.int64)), shape=(len(conversations), N_FEATURES))


def featurize(examples: Sequence[LabelledExample]) -> sp.csr_matrix:
    """The (n, N_FEATURES) feature matrix; stored features must match FEATURE_VERSION."""
    indptr: list[int] = [0]
    indices: list[int] = []
    values: list[float] = []
    for ex in examples:
        if ex.features is None:
            idx, val = extract_arrays(ex.messages or [])
            indices.extend(idx.tolist())
            values.extend(val.tolist())
        else:
            f = ex.features
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
class TrainingRows:
    """Rows ready for ``fit_heads``: features, tier index (-1 = no tier label), score target,
    sample weight and family (the within-family head's indicator)."""

    X: sp.csr_matrix
    y: np.ndarray
    s: np.ndarray
    w: np.ndarray
    fams: np.ndarray
    groups: np.ndarray = field(default_factory=lambda: np.asarray([], dtype=object))

    def __len__(self) -> int:
        return int(self.X.shape[0])

    def take(self, mask: np.ndarray) -> TrainingRows:
        return TrainingRows(self.X[mask], self.y[mask], self.s[mask], self.w[mask], self.fams[mask],
                            self.groups[mask] if len(self.groups) else self.groups)

    @staticmethod
    def stack(parts: Sequence[TrainingRows]) -> TrainingRows:
        parts = [p for p in parts if len(p)]
        groups = (np.concatenate([p.groups for p in parts]) if all(len(p.groups) == len(p) for p in parts)
                  else np.asarray([], dtype=object))
        return TrainingRows(sp.vstack([p.X for p in parts]).tocsr(), np.concatenate([p.y for p in parts]),
                            np.concatenate([p.s for p in parts]), np.concatenate([p.w for p in parts]),
                            np.concatenate([p.fams for p in parts]), groups)


@dataclass(frozen=True, eq=False)
class Heads:
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

    def combined(self, within_weight: float) -> tuple[np.ndarray, float]:
        """(coefficients, intercept) of ``raw`` as one linear function."""
        return ((self.score_coef + within_weight * self.within_coef).astype(np.float32),
                self.score_intercept - within_weight * self.within_offset)


def _fit_within(Xc: sp.csr_matrix, s: np.ndarray, fams: np.ndarray, w: np.ndarray, cfg: TrainConfig) -> np.ndarray:
    """Ridge with one (almost unpenalised) indicator per family: the indicators absorb each
    family's mean difficulty, so the feature weights can only explain difficulty *inside* a
    family (MATH Level 1 vs 5, ARC-Easy vs Challenge, LeetCode Easy vs Hard, and across the
    tasks of an outcome set, how much thinking paid) — cues that transfer to unseen kinds of
    prompt instead of recognising the source."""
    _, codes = np.unique(fams, return_inverse=True)
    n = Xc.shape[0]
    # Feedback rows get no indicator (and there is no free intercept): what the reviews say
    # must move the feature weights.
    scale = np.where(fams == "feedback", 0.0, FAMILY_SCALE)
    dummies = sp.csr_matrix((scale, (np.arange(n), codes)), shape=(n, int(codes.max()) + 1))
    reg = Ridge(alpha=cfg.within_alpha, solver="sparse_cg", fit_intercept=False)
    reg.fit(sp.hstack([Xc, dummies]).tocsr(), s, sample_weight=w)
    return np.asarray(reg.coef_[:Xc.shape[1]])


def fit_heads(rows: TrainingRows, n_classes: int, cfg: TrainConfig, *, tier_head: bool = True) -> Heads:
    """Fit on the columns the data uses (hashing leaves most empty), then expand back. Rows
    without a tier label (y = -1, e.g. outcome rows) train the score heads only; without
    ``tier_head`` the multinomial head is skipped (a routing evaluation needs the score only)."""
    X, y, s, w, fams = rows.X, rows.y, rows.s, rows.w, rows.fams
    cols = np.unique(X.indices)
    Xc = X[:, cols]
    col_scale = np.where(cols < N_DENSE, cfg.dense_scale, 1.0).astype(np.float32)
    if cfg.dense_scale != 1.0:
        Xc = (Xc @ sp.diags(col_scale)).tocsr()
    tier_coef = np.zeros((N_FEATURES, n_classes), dtype=np.float32)
    tier_intercept = np.full(n_classes, -30.0, dtype=np.float32)  # classes absent from this fit
    labelled = y >= 0
    if tier_head and len(np.unique(y[labelled])) >= 2:
        clf = LogisticRegression(C=cfg.c, solver="saga", max_iter=cfg.max_iter, tol=cfg.tol, random_state=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            clf.fit(Xc[labelled], y[labelled], sample_weight=w[labelled])
        present = clf.classes_.astype(int)
        if len(present) == 2:  # sklearn keeps one column for two classes: split it symmetrically
            tier_coef[np.ix_(cols, present)] = np.stack([-clf.coef_[0] / 2, clf.coef_[0] / 2], axis=1) * col_scale[:, None]
            tier_intercept[present] = [-clf.intercept_[0] / 2, clf.intercept_[0] / 2]
        else:
            tier_coef[np.ix_(cols, present)] = clf.coef_.T * col_scale[:, None]
            tier_intercept[present] = clf.intercept_
    reg = Ridge(alpha=cfg.ridge_alpha, solver="sparse_cg")
    keep = np.asarray([not (c < N_DENSE and DENSE_NAMES[c] in cfg.cross_excluded) for c in cols])
    reg.fit(Xc[:, np.flatnonzero(keep)], s, sample_weight=w)
    score_coef = np.zeros(N_FEATURES, dtype=np.float32)
    score_coef[cols[keep]] = reg.coef_ * col_scale[keep]
    within_coef = np.zeros(N_FEATURES, dtype=np.float32)
    within_coef[cols] = _fit_within(Xc, s, fams, w, cfg) * col_scale
    offset = float(np.average(np.asarray(X[:, cols] @ within_coef[cols]).ravel(), weights=w))
    return Heads(tier_coef, tier_intercept, score_coef, float(reg.intercept_), within_coef, offset)


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)
