"""Outcome data as training rows for the score, and its honest (held-out group) evaluation.

An outcome item with both a cheap and a strong arm says how much the stronger arm paid on that
prompt: gain = strong − cheap in [−1, 1]. Each item becomes one score row with target
``outcome_center + outcome_scale × gain`` (clipped to [0, 1]) and no tier label. All rows of an
outcome set form one *family* (``outcome:<set>``): the within-family head's indicator absorbs
the set's level, so the shared feature weights must explain, together, the difficulty inside
each source-derived family and where thinking paid across the set's tasks — the outcome data
is trained *with* the source labels, not instead of them. Rows are weighted 1/sqrt(size of
their group) and, all together, ``outcome_share`` of the total training weight.

``grouped_outcome_scores`` refits the score heads with whole groups (tasks) held out and the
source rows always in training: the scores it returns come from models that never saw the
held-out groups.

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from classifier.gain import GainHead, combine_scale, fit_gain_head, fold_gain
from classifier.heads import TrainConfig, TrainingRows, featurize_messages, fit_heads
from classifier.model import squash_score
from classifier.outcomes import CHEAP_ARM, KNOWN_MAPPINGS, STRONG_ARM, OutcomeItem, load_outcome_items
from classifier.types import ClassifierError

OUTCOME_PREFIX = "outcome:"


def outcome_family(set_name: str) -> str:
    return OUTCOME_PREFIX + set_name


def outcome_rows(sets: Mapping[str, Sequence[OutcomeItem]], cfg: TrainConfig, *, cheap: str = CHEAP_ARM,
                 strong: str = STRONG_ARM) -> TrainingRows:
    """Score rows for every item with both arms (weights not yet scaled: see ``scale_weights``)."""
    msgs, targets, weights, fams, groups = [], [], [], [], []
    for name, items in sets.items():
        usable = [it for it in items if it.has(cheap, strong)]
        sizes = Counter(it.group for it in usable)
        for it in usable:
            msgs.append(it.messages)
            targets.append(min(max(cfg.outcome_center + cfg.outcome_scale * it.gain(cheap, strong), 0.0), 1.0))
            weights.append(1.0 / np.sqrt(sizes[it.group]))
            fams.append(outcome_family(name))
            groups.append(f"{name}/{it.group}")
    n = len(msgs)
    return TrainingRows(featurize_messages(msgs), np.full(n, -1, dtype=np.int64), np.asarray(targets, dtype=float),
                        np.asarray(weights, dtype=float), np.asarray(fams, dtype=object),
                        np.asarray(groups, dtype=object))


def scale_weights(rows: TrainingRows, source_weight_total: float, share: float) -> TrainingRows:
    """The rows with weights summing to ``share`` of the combined (source + outcome) weight."""
    if not len(rows) or share <= 0:
        return rows.take(np.zeros(len(rows), dtype=bool))
    w = rows.w / rows.w.sum() * source_weight_total * share / (1.0 - share)
    return TrainingRows(rows.X, rows.y, rows.s, w, rows.fams, rows.groups)


def group_folds(groups: Sequence[str] | np.ndarray, k: int | None, seed: int = 0) -> list[np.ndarray]:
    """Boolean test masks holding out whole groups: ``k`` shuffled folds, or one per group (None)."""
    g = np.asarray(groups, dtype=object)
    names = sorted(set(g.tolist()))
    if len(names) < 2:
        raise ClassifierError("holding out groups needs at least two groups")
    if k is None or k >= len(names):
        return [g == name for name in names]
    perm = [names[i] for i in np.random.default_rng(seed).permutation(len(names))]
    return [np.isin(g, perm[f::k]) for f in range(k)]


def gain_of_rows(rows: TrainingRows, cfg: TrainConfig) -> np.ndarray:
    """The measured gain (strong − cheap) of outcome rows, back from their score target."""
    return (rows.s - cfg.outcome_center) / cfg.outcome_scale


def with_gain_head(coef: np.ndarray, intercept: float, rows: TrainingRows | None,
                   cfg: TrainConfig, head: GainHead | None = None) -> tuple[np.ndarray, float, GainHead | None, float]:
    """Score coefficients plus the gain head fitted on the outcome ``rows`` (classifier.gain), the
    head and its scale; unchanged (head None) without rows, with fewer than two groups, or with
    ``gain_weight`` 0. The targets are clipped to [0, 1] only beyond |gain| > 1.29, which a gain in
    [−1, 1] never reaches, so the gain read back is exact. A ``head`` already fitted on these rows
    is reused (only its scale against this score is recomputed)."""
    if rows is None or not len(rows) or cfg.gain_weight <= 0 or len(set(rows.groups.tolist())) < 2:
        return coef, intercept, None, 0.0
    if head is None:
        head = fit_gain_head(rows.X, np.zeros(len(rows)), gain_of_rows(rows, cfg), rows.groups, cfg.gain_alphas)
    base = np.asarray(rows.X @ coef).ravel() + intercept
    scale = combine_scale(base, head.predict(rows.X), cfg.gain_weight)
    new_coef, new_intercept = fold_gain(coef, intercept, head, scale)
    return new_coef, new_intercept, head, scale


def grouped_outcome_scores(source: TrainingRows, rows: TrainingRows, cfg: TrainConfig, n_classes: int,
                           folds: Sequence[np.ndarray], *, other: TrainingRows | None = None,
                           progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Held-out scores of ``rows``: for each fold, the score is rebuilt from the source rows plus
    the outcome rows outside the fold and the ``other`` outcome rows, exactly as ``train`` builds it:
    the ridge heads (refitted per fold only when outcome rows are mixed into them, ``outcome_share``
    > 0; otherwise they never see an outcome row and are fitted once) and the gain head (always
    refitted per fold, its L2 strength chosen inside the fold's training groups)."""
    out = np.full(len(rows), np.nan)
    total = float(source.w.sum())
    shared = None if cfg.outcome_share > 0 else fit_heads(source, n_classes, cfg, tier_head=False)
    for k, test in enumerate(folds):
        outcome_train = TrainingRows.stack([rows.take(~test), *([other] if other is not None and len(other) else [])])
        if shared is None:
            train_rows = TrainingRows.stack([source, scale_weights(outcome_train, total, cfg.outcome_share)])
            heads = fit_heads(train_rows, n_classes, cfg, tier_head=False)
        else:
            heads = shared
        coef, intercept = heads.combined(cfg.within_weight)
        coef, intercept, _, _ = with_gain_head(coef, intercept, outcome_train, cfg)
        out[test] = squash_score(np.asarray(rows.X[test] @ coef).ravel() + intercept)
        if progress is not None:
            progress(k + 1, len(folds))
    return out



def load_outcome_sets(data_dir: str | Path) -> dict[str, list[OutcomeItem]]:
    """Every outcome file in ``<data_dir>/outcomes`` whose rows a known mapping (or the generic
    format) reads, by file stem. Files that are not outcome sets are skipped."""
    folder = Path(data_dir) / "outcomes"
    sets: dict[str, list[OutcomeItem]] = {}
    if not folder.is_dir():
        return sets
    for path in sorted(folder.glob("*.jsonl")):
        with path.open(encoding="utf-8") as fh:
            first = next((ln for ln in fh if ln.strip()), "")
        try:
            row = json.loads(first) if first else {}
        except json.JSONDecodeError:
            continue
        if any(m.matches(row) for m in KNOWN_MAPPINGS) or "outcomes" in row:
            sets[path.stem] = load_outcome_items(path)
    return sets
