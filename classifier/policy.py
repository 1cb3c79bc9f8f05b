"""The routing decision the gateway logs: the model's tier, explored with a small probability, with
the propensity of the tier that was chosen — what makes later learning and evaluation off-policy
and honest (every logged decision carries its action, its probability and, later, its reward).

``Router.route`` = the model's decision (score → tier through traffic-calibrated thresholds) +
epsilon-greedy exploration over the arms: with probability ``epsilon`` a uniformly random arm
replaces the greedy one. ``RouteDecision.record(outcome, cost)`` turns the decision and what came
of it into the ``OutcomeRecord`` the learner and the promotion guard read.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from classifier.features import FEATURE_VERSION, extract_arrays
from classifier.model import EffortModel
from classifier.outcomes import OutcomeRecord
from classifier.types import TIERS, ClassifierError, EffortDecision, Message, SparseFeatures, user_prompt

DEFAULT_EPSILON = 0.05


def epsilon_greedy(greedy: str, arms: Sequence[str], epsilon: float, rng: random.Random) -> tuple[str, float, bool]:
    """(chosen arm, its propensity, whether exploration replaced the greedy arm)."""
    if not 0.0 <= epsilon <= 1.0:
        raise ClassifierError(f"epsilon must be in [0, 1], got {epsilon}")
    if greedy not in arms:
        raise ClassifierError(f"greedy arm {greedy!r} is not among the arms {list(arms)}")
    k = len(arms)
    chosen = arms[rng.randrange(k)] if rng.random() < epsilon else greedy
    propensity = (1.0 - epsilon) * (chosen == greedy) + epsilon / k
    return chosen, propensity, chosen != greedy


@dataclass(frozen=True)
class RouteDecision:
    """What the gateway runs (``tier``) and must log with the outcome: the score, the greedy tier,
    the propensity of ``tier`` and the hashed features (so the record can be learned from even
    when the prompt text may not be stored)."""

    tier: str
    score: float
    greedy_tier: str
    propensity: float
    explored: bool
    version: str
    decision: EffortDecision
    features: SparseFeatures

    def record(self, outcome: float, *, cost: float | None = None, tenant: str | None = None,
               messages: Sequence[Message] | None = None, timestamp: float | None = None) -> OutcomeRecord:
        """The logged record of this decision once its outcome (in [0, 1]) is known."""
        return OutcomeRecord(arm=self.tier, outcome=outcome, messages=messages, features=self.features, cost=cost,
                             propensity=self.propensity, timestamp=timestamp, tenant=tenant)


class Router:
    """Decisions with exploration and propensities over a (hot-swappable) model."""

    def __init__(self, model: EffortModel, *, epsilon: float = DEFAULT_EPSILON, arms: Sequence[str] = TIERS,
                 rng: random.Random | None = None) -> None:
        if epsilon < 0 or epsilon > 1:
            raise ClassifierError(f"epsilon must be in [0, 1], got {epsilon}")
        self.model = model
        self.epsilon = epsilon
        self.arms = tuple(arms)
        self.rng = rng or random.Random()

    def swap(self, model: EffortModel) -> None:
        """Use ``model`` from now on, keeping its traffic window if it has none (a hot reload)."""
        if model.traffic is None and self.model.traffic is not None:
            model = model.with_traffic(self.model.traffic)
        self.model = model

    def route(self, messages: Sequence[Message] | str, tenant: str | None = None) -> RouteDecision:
        idx, val = extract_arrays(user_prompt(messages) if isinstance(messages, str) else messages)
        decision = self.model.decide_arrays(idx, val, tenant)
        greedy = decision.tier if decision.tier in self.arms else min(
            self.arms, key=lambda a: abs(TIERS.index(a) - TIERS.index(decision.tier)) if a in TIERS else 99)
        tier, propensity, explored = epsilon_greedy(greedy, self.arms, self.epsilon, self.rng)
        features = SparseFeatures(tuple(idx.tolist()), tuple(val.tolist()), FEATURE_VERSION)
        return RouteDecision(tier, decision.score, greedy, propensity, explored, decision.version, decision, features)
