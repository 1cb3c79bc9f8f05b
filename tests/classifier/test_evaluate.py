"""Routing maths against hand-computed tiny cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from classifier import apgr, auroc, bootstrap, cpt, metrics, oracle_scores, prequential, routing_curve

CHEAP = [1, 0, 0, 1]
STRONG = [1, 1, 1, 1]  # cheap quality 0.5, strong 1.0, gap 0.5


def test_oracle_on_hand_case() -> None:
    # Oracle routes the two prompts the strong model fixes first: shares 0, .5, 1 →
    # quality .5, 1, 1 → PGR 0, 1, 1 → area .25 + .5 = .75.
    curve = routing_curve(oracle_scores(CHEAP, STRONG), CHEAP, STRONG)
    assert curve.shares.tolist() == [0.0, 0.5, 1.0]
    assert curve.quality.tolist() == [0.5, 1.0, 1.0]
    m = metrics(oracle_scores(CHEAP, STRONG), CHEAP, STRONG)
    assert m.apgr == pytest.approx(0.75)
    assert m.cpt50 == pytest.approx(0.25)
    assert m.cpt80 == pytest.approx(0.4)


def test_inverted_router_on_hand_case() -> None:
    # Worst first: quality .5, .5, 1 → PGR 0, 0, 1 → area .25; CPT(50%) = .75, CPT(80%) = .9.
    m = metrics(-oracle_scores(CHEAP, STRONG), CHEAP, STRONG)
    assert m.apgr == pytest.approx(0.25)
    assert m.cpt50 == pytest.approx(0.75)
    assert m.cpt80 == pytest.approx(0.9)


def test_constant_score_is_exactly_the_random_router() -> None:
    m = metrics([0.3] * 4, CHEAP, STRONG)
    assert m.apgr == pytest.approx(0.5)
    assert m.cpt50 == pytest.approx(0.5)
    assert m.cpt80 == pytest.approx(0.8)


def test_oracle_with_one_fixable_prompt_in_ten() -> None:
    cheap = [1] * 9 + [0]
    strong = [1] * 10
    # PGR jumps to 1 at share .1 and stays: area .05 + .9 = .95.
    assert apgr(routing_curve(oracle_scores(cheap, strong), cheap, strong)) == pytest.approx(0.95)


def test_random_scores_average_one_half_and_inversion_mirrors() -> None:
    rng = np.random.default_rng(0)
    cheap = rng.random(2000) < 0.6
    strong = rng.random(2000) < 0.85
    values = [metrics(rng.random(2000), cheap, strong).apgr for _ in range(20)]
    assert abs(float(np.mean(values)) - 0.5) < 0.03
    scores = rng.random(2000)
    assert metrics(scores, cheap, strong).apgr + metrics(-scores, cheap, strong).apgr == pytest.approx(1.0)


def test_scores_outcomes_in_unit_interval_and_zero_gap() -> None:
    m = metrics([0.9, 0.1], [0.2, 0.8], [0.7, 0.4])  # cheap .5, strong .55
    curve = routing_curve([0.9, 0.1], [0.2, 0.8], [0.7, 0.4])
    assert curve.quality.tolist() == pytest.approx([0.5, 0.75, 0.55])
    assert m.apgr == pytest.approx((0 + 5) / 2 * 0.5 + (5 + 1) / 2 * 0.5)  # PGR 0, 5, 1: oracle beats 1
    assert math.isnan(metrics([1, 0], [1, 0], [1, 0]).apgr)  # no gap: undefined, not a crash
    assert math.isnan(cpt(routing_curve([1, 0], [1, 0], [1, 0]), 0.5))


def test_auroc_hand_case_and_ties() -> None:
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auroc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert math.isnan(auroc([0.1, 0.2], [1, 1]))


def test_bootstrap_interval_brackets_estimate() -> None:
    rng = np.random.default_rng(1)
    cheap = rng.random(300) < 0.5
    strong = np.ones(300)
    scores = (~cheap).astype(float) + rng.normal(0, 0.8, 300)  # informative but noisy
    ci = bootstrap(scores, cheap, strong, n_boot=100, seed=0)
    for iv in ci.values():
        assert iv.low <= iv.estimate <= iv.high
    assert ci["apgr"].low > 0.5  # clearly better than random


def test_prequential_scores_before_learning() -> None:
    seen: list[int] = []
    out = prequential(lambda i: float(len(seen)), seen.append, 3)
    assert out.tolist() == [0.0, 1.0, 2.0]  # item i was scored before it was learned
