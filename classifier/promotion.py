"""The promotion guard: a learned update goes live only if it routes a held-back slice of logged
traffic at least as well as the current model, estimated off-policy.

Each model is turned into a policy on the held-back records: its scores on them, cut into tiers
at the same target shares (so both policies spend alike), each tier mapped to the nearest arm
that appears in the log. The value of a policy is the self-normalised inverse-propensity
estimate of its mean outcome, Σ wᵢ rᵢ [π(xᵢ) = aᵢ] / Σ wᵢ [π(xᵢ) = aᵢ] with wᵢ = 1/pᵢ, averaged
over a few strong-tier shares. A candidate is refused when its value is below the current one's
by more than ``tolerance``, or when too few records agree with it to say (effective sample size
below ``min_effective``).

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from classifier.features import extract_arrays, to_arrays
from classifier.model import EffortModel
from classifier.online import OffPolicyLearner
from classifier.outcomes import OutcomeRecord
from classifier.thresholds import DEFAULT_TIER_MIX, full_mix, mix_with_strong_share, thresholds_from_scores
from classifier.types import TIERS, ClassifierError

Scorer = Callable[[np.ndarray, np.ndarray, str | None], float]
DEFAULT_STRONG_SHARES = (0.2, 0.35, 0.5)


@dataclass(frozen=True)
class PolicyValue:
    value: float  # self-normalised IPS mean outcome, averaged over the mixes
    effective: float  # smallest effective sample size of the matched records over the mixes
    matched: int  # records whose logged arm the policy would have chosen (summed over the mixes)


@dataclass(frozen=True)
class PromotionVerdict:
    accepted: bool
    current: PolicyValue
    candidate: PolicyValue
    reason: str


def model_scorer(model: EffortModel) -> Scorer:
    """Raw scores of ``model`` (tenant corrections included; its traffic window is untouched)."""
    return model.raw_score


def _arrays(records: Sequence[OutcomeRecord]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [to_arrays(r.features) if r.features is not None else extract_arrays(r.messages or [])
            for r in records]


def _nearest_logged(tier: str, logged: Sequence[str]) -> str:
    known = [a for a in logged if a in TIERS]
    if tier in logged or not known:
        return tier
    return min(known, key=lambda a: (abs(TIERS.index(a) - TIERS.index(tier)), TIERS.index(a)))


def policy_value(scores: np.ndarray, records: Sequence[OutcomeRecord], mixes: Sequence[Sequence[float]],
                 max_weight: float = 100.0) -> PolicyValue:
    """The off-policy value of routing by ``scores`` at each of ``mixes`` (six tier shares)."""
    arms = [r.arm for r in records]
    logged = sorted(set(arms), key=lambda a: TIERS.index(a) if a in TIERS else len(TIERS))
    r = np.asarray([rec.outcome for rec in records])
    w = np.minimum(1.0 / np.asarray([rec.propensity for rec in records]), max_weight)
    values, effective, matched = [], [], 0
    for shares in mixes:
        cuts = thresholds_from_scores(scores, shares)
        tiers = np.searchsorted(np.asarray(cuts), scores, side="right")
        chosen = [_nearest_logged(TIERS[t], logged) for t in tiers]
        m = np.asarray([c == a for c, a in zip(chosen, arms, strict=True)])
        if not m.any():
            values.append(float("nan"))
            effective.append(0.0)
            continue
        wm = w[m]
        values.append(float((wm * r[m]).sum() / wm.sum()))
        effective.append(float(wm.sum() ** 2 / (wm * wm).sum()))
        matched += int(m.sum())
    return PolicyValue(float(np.mean(values)), float(min(effective)), matched)


def promotion_guard(current: EffortModel | Scorer, candidate: EffortModel | Scorer,
                    held_back: Sequence[OutcomeRecord], *, mix: dict[str, float] | None = None,
                    strong_shares: Sequence[float] = DEFAULT_STRONG_SHARES, tolerance: float = 0.0,
                    min_effective: float = 30.0) -> PromotionVerdict:
    """Accept ``candidate`` only if its off-policy value on ``held_back`` is not below ``current``'s
    by more than ``tolerance`` and enough records support the estimate."""
    if not held_back:
        raise ClassifierError("the promotion guard needs held-back logged records")
    base = full_mix(mix or DEFAULT_TIER_MIX)
    mixes = [mix_with_strong_share(base, q) for q in strong_shares]
    arrays = _arrays(held_back)

    def scores(m: EffortModel | Scorer) -> np.ndarray:
        fn = model_scorer(m) if isinstance(m, EffortModel) else m
        return np.asarray([fn(i, v, r.tenant) for (i, v), r in zip(arrays, held_back, strict=True)])

    cur = policy_value(scores(current), held_back, mixes)
    cand = policy_value(scores(candidate), held_back, mixes)
    if cand.effective < min_effective:
        return PromotionVerdict(False, cur, cand, f"too little evidence: effective sample {cand.effective:.0f} "
                                                  f"< {min_effective:.0f} records agree with the candidate")
    if not cand.value >= cur.value - tolerance:
        return PromotionVerdict(False, cur, cand, f"candidate routes worse on held-back traffic: "
                                                  f"{cand.value:.4f} < {cur.value:.4f} - {tolerance}")
    return PromotionVerdict(True, cur, cand, f"candidate {cand.value:.4f} >= current {cur.value:.4f} - {tolerance}")




@dataclass(frozen=True)
class UpdateResult:
    candidate: EffortModel
    verdict: PromotionVerdict
    learned: int  # records the learner updated on
    held_back: int  # records kept for the guard


def learn_and_guard(current: EffortModel, learner: OffPolicyLearner, records: Sequence[OutcomeRecord], *,
                    version: str, holdback: float = 0.2, mix: dict[str, float] | None = None,
                    tolerance: float = 0.0, min_effective: float = 30.0) -> UpdateResult:
    """One incremental update: records in time order (those without a timestamp keep their order),
    the last ``holdback`` share held back; the learner updates on the rest, and its model is
    checked against ``current`` on the held-back slice. The caller publishes ``candidate`` only if
    ``verdict.accepted``."""
    if not 0.0 < holdback < 1.0:
        raise ClassifierError("holdback must be in (0, 1)")
    ordered = sorted(records, key=lambda r: r.timestamp or 0.0) \
        if all(r.timestamp is not None for r in records) else list(records)
    cut = round(len(ordered) * (1.0 - holdback))
    train_part, held = ordered[:cut], ordered[cut:]
    if not held:
        raise ClassifierError("no records left to hold back")
    learned = learner.update_many(train_part)
    candidate = learner.to_model(version)
    verdict = promotion_guard(current, candidate, held, mix=mix, tolerance=tolerance, min_effective=min_effective)
    return UpdateResult(candidate, verdict, learned, len(held))


__all__ = [
    "DEFAULT_STRONG_SHARES",
    "TIERS",
    "PolicyValue",
    "PromotionVerdict",
    "Scorer",
    "model_scorer",
    "policy_value",
    "promotion_guard",
]
