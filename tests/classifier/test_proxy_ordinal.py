"""The proxy routing evaluation, the ordinal probabilities and the difficulty cues."""

from __future__ import annotations

import numpy as np
import pytest

from classifier import LabelledExample, user_prompt
from classifier.cues import CUE_NAMES, difficulty_cues
from classifier.ordinal import fit_ordinal, log_loss, ordinal_probs
from classifier.proxy import cheap_outcome, family, proxy_apgr
from classifier.scan import Scan


def _ex(tier: str, source: str) -> LabelledExample:
    return LabelledExample(tier=tier, score=0.5, source=source, messages=user_prompt("x"))


def test_proxy_apgr_of_oracle_random_and_inverted_rankings() -> None:
    tiers = ["low"] * 30 + ["high"] * 30
    exs = [_ex(t, "arc_easy" if i % 2 else "arc_challenge") for i, t in enumerate(tiers)]
    hard_first = np.asarray([0.0] * 30 + [1.0] * 30)
    # Oracle: the 30 failures are routed first, so PGR rises linearly to 1 at share 0.5, then stays.
    assert proxy_apgr(exs, hard_first) == {"arc": pytest.approx(0.75)}
    assert proxy_apgr(exs, np.zeros(60))["arc"] == pytest.approx(0.5)  # constant = random router
    assert proxy_apgr(exs, -hard_first)["arc"] == pytest.approx(0.25)  # inverted
    # A family whose labels do not vary (one tier) cannot rank anything: skipped.
    assert proxy_apgr([_ex("none", "nq_open")] * 30, np.arange(30.0)) == {}


def test_family_groups_splits_and_cheap_outcomes_follow_the_tier() -> None:
    assert family("arc_easy") == family("arc_challenge") == "arc" and family("math") == "math"
    assert [cheap_outcome(t) for t in ("none", "low", "medium", "high", "xhigh")] == [1.0, 1.0, 0.5, 0.0, 0.0]


def test_ordinal_fit_recovers_a_known_model_and_beats_uniform() -> None:
    rng = np.random.default_rng(0)
    raw = rng.normal(3.0, 2.0, size=4000)
    true_cuts = np.asarray([2.0, 4.0, 6.0, 7.0])
    p = ordinal_probs(raw, 1.5, true_cuts)
    y = np.asarray([rng.choice(5, p=row) for row in p])
    slope, cuts = fit_ordinal(raw, y, 5)
    assert slope == pytest.approx(1.5, rel=0.1)
    assert np.allclose(cuts, true_cuts, atol=0.35)
    fitted = ordinal_probs(raw, slope, np.asarray(cuts))
    assert np.allclose(fitted.sum(axis=1), 1.0)
    assert log_loss(fitted, y) < log_loss(np.full((len(y), 5), 0.2), y) - 0.3
    assert (np.diff(fitted[np.argsort(raw)][:, -1]) >= -1e-12).all()  # top class grows with the score


def test_cues_see_short_hard_prompts_and_factoid_shape() -> None:
    def cues(text: str) -> dict[str, float]:
        return dict(zip(CUE_NAMES, difficulty_cues(Scan(text)), strict=True))

    proof = cues("Prove that sqrt(2) is irrational.")
    story = cues("Write a story about a dragon who loves tea and visits the village market every Sunday.")
    fact = cues("Who was the first president of the United States?")
    assert proof["proof_cues"] > 0 and story["proof_cues"] == 0
    assert story["creative_cues"] > 0 and story["imperative_start"] == 1.0
    assert fact["factoid_shape"] == 1.0 and proof["factoid_shape"] == 0.0
    latex = cues(r"Find all $n$ such that $\sum_{k=1}^{n} k^2 \equiv 0 \pmod{n}$.")
    assert latex["latex_density"] > 0.3 and latex["quantifier_cues"] > 0
