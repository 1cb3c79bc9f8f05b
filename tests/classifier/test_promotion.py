"""Exploration with logged propensities, and the promotion guard: an update that routes held-back
logged traffic worse than the current model is refused, a better one is accepted, and a verdict
without enough evidence is a refusal."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from classifier import (
    LearnerConfig,
    OffPolicyLearner,
    Router,
    TrainConfig,
    epsilon_greedy,
    learn_and_guard,
    promotion_guard,
    train,
    user_prompt,
)
from classifier.model import EffortModel
from tests.classifier.synthetic import tiny_dataset
from tests.classifier.test_learner import ARMS, log_decisions


@pytest.fixture(scope="module")
def base() -> EffortModel:
    return train(tiny_dataset(), TrainConfig(), cv=False, version="base").model


def test_epsilon_greedy_propensities_match_frequencies() -> None:
    r = random.Random(0)
    arms = ("none", "low", "high")
    draws = [epsilon_greedy("low", arms, 0.3, r) for _ in range(20000)]
    freq = Counter(a for a, _, _ in draws)
    for arm, p, explored in draws[:50]:
        assert p == pytest.approx(0.8 if arm == "low" else 0.1)
        assert explored == (arm != "low")
    assert {a: freq[a] / len(draws) for a in arms} == pytest.approx({"none": 0.1, "low": 0.8, "high": 0.1}, abs=0.01)
    assert epsilon_greedy("low", arms, 0.0, r) == ("low", 1.0, False)


def test_router_logs_the_propensity_of_what_it_ran(base: EffortModel) -> None:
    router = Router(base, epsilon=0.5, rng=random.Random(1))
    decisions = [router.route(user_prompt(f"Tom has {i} apples and buys 3 more. How many now?")) for i in range(200)]
    explored = [d for d in decisions if d.explored]
    assert 0.3 < len(explored) / len(decisions) < 0.6  # 0.5 explore, of which 1/6 land on the greedy tier
    for d in decisions:
        assert d.propensity == pytest.approx(0.5 / 6 + (0.5 if d.tier == d.greedy_tier else 0.0))
    rec = decisions[0].record(1.0, cost=0.01, tenant="t")
    assert (rec.arm, rec.propensity, rec.tenant, rec.features) == (decisions[0].tier, decisions[0].propensity, "t",
                                                                    decisions[0].features)


def _learned(base: EffortModel, seed: int) -> tuple[EffortModel, list]:
    learner = OffPolicyLearner(base, LearnerConfig(arms=ARMS))
    learner.update_many([rec for rec, _ in log_decisions(base, 2500, epsilon=0.2, seed=seed)])
    return learner.to_model("base+u"), [rec for rec, _ in log_decisions(base, 1500, epsilon=0.3, seed=seed + 100)]


@pytest.mark.slow
def test_guard_refuses_a_worse_update_and_accepts_a_better_one(base: EffortModel) -> None:
    good, held_back = _learned(base, 5)
    worse = dataclasses.replace(good, score_coef=-good.score_coef, score_intercept=1 - good.score_intercept,
                                version="base+worse")  # the same update, inverted
    assert promotion_guard(base, good, held_back).accepted
    verdict = promotion_guard(good, worse, held_back)
    assert not verdict.accepted and "worse" in verdict.reason
    assert verdict.candidate.value < verdict.current.value - 0.05
    # with (almost) no logged record agreeing with the candidate, there is no evidence: refused
    thin = promotion_guard(good, worse, held_back[:20], min_effective=30)
    assert not thin.accepted and "evidence" in thin.reason


def test_learn_and_guard_holds_back_the_latest_records(base: EffortModel) -> None:
    records = [rec for rec, _ in log_decisions(base, 2000, epsilon=0.2, seed=7)]
    timed = [dataclasses.replace(r, timestamp=float(len(records) - i)) for i, r in enumerate(records)]
    learner = OffPolicyLearner(base, LearnerConfig(arms=ARMS))
    result = learn_and_guard(base, learner, timed, version="base+u7", holdback=0.25)
    assert (result.learned, result.held_back) == (1500, 500)
    assert result.verdict.accepted and result.candidate.parent_version == "base"
    assert result.verdict.candidate.value > result.verdict.current.value and learner.seen == 1500
