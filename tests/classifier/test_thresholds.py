"""Thresholds from a target, calibrated on traffic: every tier reachable, the mix held on the
scores actually seen, quality and cost targets, and a model whose tier follows its score."""

from __future__ import annotations

import random

import numpy as np
import pytest

from classifier import (
    DEFAULT_TIER_MIX,
    TIERS,
    ClassifierError,
    RoutingTarget,
    ScoreWindow,
    TrainConfig,
    full_mix,
    mix_with_strong_share,
    thresholds_from_scores,
    train,
    user_prompt,
)
from classifier.thresholds import strong_share_for_cost, strong_share_for_quality
from tests.classifier.synthetic import prompts_of, tiny_dataset


def _mix(scores: np.ndarray, cuts: tuple[float, ...]) -> np.ndarray:
    return np.bincount(np.searchsorted(np.asarray(cuts), scores, side="right"), minlength=6) / len(scores)


def test_partial_mix_spreads_over_all_six_tiers() -> None:
    shares = full_mix({"low": 0.7, "medium": 0.2, "high": 0.1})
    assert shares == pytest.approx((0.7 / 3, 0.7 / 3, 0.7 / 3, 0.2, 0.05, 0.05))
    assert full_mix(DEFAULT_TIER_MIX) == pytest.approx(tuple(DEFAULT_TIER_MIX[t] for t in TIERS))
    with pytest.raises(ClassifierError):
        full_mix({"huge": 1.0})


def test_thresholds_hit_the_mix_even_with_ties_and_reach_every_tier() -> None:
    rng = np.random.default_rng(0)
    scores = np.round(rng.beta(2, 5, 5000), 2)  # many ties
    shares = full_mix(DEFAULT_TIER_MIX)
    assert _mix(scores, thresholds_from_scores(scores, shares)) == pytest.approx(shares, abs=0.03)
    narrow = 0.4 + 0.001 * rng.random(3000)  # a homogeneous stream (e.g. all maths word problems)
    got = _mix(narrow, thresholds_from_scores(narrow, shares))
    assert (got > 0).all() and got == pytest.approx(shares, abs=0.01)


def test_score_window_calibrates_on_the_traffic_it_sees() -> None:
    window = ScoreWindow(size=1000, min_count=200, refresh=50)
    shares = full_mix(DEFAULT_TIER_MIX)
    assert window.thresholds(shares) is None  # not warm yet
    rng = np.random.default_rng(1)
    window.extend(rng.normal(0.2, 0.05, 1000))
    low_cuts = window.thresholds(shares)
    window.extend(rng.normal(0.8, 0.05, 1000))  # traffic shifts: the window forgets the old scores
    high_cuts = window.thresholds(shares)
    assert low_cuts is not None and high_cuts is not None
    assert min(high_cuts) > max(low_cuts)
    assert _mix(rng.normal(0.8, 0.05, 4000), high_cuts) == pytest.approx(shares, abs=0.03)


def test_quality_and_cost_targets_set_the_strong_share() -> None:
    shares = np.linspace(0, 1, 11)
    pgr = np.sqrt(shares)  # a concave routing curve
    assert strong_share_for_quality(shares, pgr, 0.8) == pytest.approx(0.64, abs=0.02)
    target = RoutingTarget(mix=DEFAULT_TIER_MIX, quality=0.8, quality_curve=(shares, pgr))
    s = target.shares()
    assert s[4] + s[5] == pytest.approx(0.64, abs=0.02) and min(s) > 0
    base = full_mix(DEFAULT_TIER_MIX)
    costs = {"none": 0.0, "minimal": 0.01, "low": 0.05, "medium": 0.2, "high": 1.0, "xhigh": 2.0}
    q = strong_share_for_cost(base, costs, 0.25)
    spent = float(np.dot(mix_with_strong_share(base, q), [costs[t] for t in TIERS]))
    assert spent == pytest.approx(0.25 * 2.0, rel=1e-3)
    assert strong_share_for_cost(base, costs, 0.4) > q
    with pytest.raises(ClassifierError):
        RoutingTarget(mix=DEFAULT_TIER_MIX, quality=0.8).shares()


def test_model_tier_follows_its_score_and_reaches_all_tiers_on_traffic() -> None:
    # Traffic of mostly one kind (arithmetic), unlike the training mix: the stored thresholds would
    # put it all in a band or two; the window spreads it over the six tiers.
    convs = [user_prompt(p) for p in prompts_of(1, 200, seed=7)] + [user_prompt(p) for p in prompts_of(3, 40)]
    random.Random(0).shuffle(convs)
    model = train(tiny_dataset(), TrainConfig(), cv=False).model
    stored = {model.decide(c).tier for c in convs}
    live = model.with_traffic(ScoreWindow(size=1000, min_count=len(convs), refresh=10**6))
    decisions = [live.decide(c) for c in convs * 2]
    late = decisions[len(convs):]  # the window is warm: thresholds come from this traffic
    assert len(stored) < len(TIERS)
    assert {d.tier for d in late} == set(TIERS)
    order = np.argsort([d.score for d in late], kind="stable")
    tiers = [TIERS.index(late[i].tier) for i in order]
    assert tiers == sorted(tiers)  # the tier ordering carries the score's ranking
