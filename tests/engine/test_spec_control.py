"""The speculation controller (`engine.spec_control`) with plain numbers: the verify-cost curve read off the
measured draft lengths, acceptance per draft position, the draft length the two choose, and a sequence's
heuristic length and pauses."""

from __future__ import annotations

import math

import pytest

from engine.spec_control import Acceptance, SpecConfig, SpecCosts, SpecState, best_draft


def _costs(plain: float, verify: dict[int, float], draft_token: float = 0.0) -> SpecCosts:
    costs = SpecCosts()
    costs.record_plain(plain)
    for k, seconds in verify.items():
        costs.record_verify(seconds, k)
    if draft_token:
        costs.record_draft("self", 3 * draft_token, 3)
    return costs


def test_verify_costs_interpolate_the_measured_lengths_and_never_fall() -> None:
    assert SpecCosts().verify_costs(4) is None
    costs = _costs(1.0, {2: 1.5})
    assert costs.verify_costs(4) == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0])  # one length: a straight line
    costs = _costs(1.0, {1: 1.2, 2: 1.5, 4: 1.4, 6: 2.0})  # a noisy 4 below the 2: held at 1.5
    assert costs.verify_costs(8) == pytest.approx([1.0, 1.2, 1.5, 1.5, 1.5, 1.75, 2.0, 2.25, 2.5])
    assert costs.verify_cost(3) == pytest.approx(1.5)


def test_a_length_measured_once_or_twice_does_not_bend_a_settled_curve() -> None:
    costs = _costs(1.0, {})
    for _ in range(3):
        costs.record_verify(1.5, 1)
        costs.record_verify(2.5, 4)
    costs.record_verify(9.0, 2)  # one step the machine delayed, at a length tried once
    assert costs.verify_costs(4) == pytest.approx([1.0, 1.5, 1.833, 2.167, 2.5], abs=1e-3)
    for _ in range(2):
        costs.record_verify(1.6, 2)
    assert (costs.verify_costs(4) or [])[2] == pytest.approx(1.6)  # three samples: its median counts


def test_best_draft_answers_again_after_new_evidence_or_costs() -> None:
    costs = _costs(1.0, {1: 1.1, 4: 1.4})
    acc = Acceptance(8)
    for _ in range(20):
        acc.record(4, 0)
    assert best_draft(costs, "prompt_lookup", acc, 8) == (0, 0.0)
    assert best_draft(costs, "prompt_lookup", acc, 8) == (0, 0.0)  # the kept answer
    for _ in range(60):
        acc.record(4, 4)
    assert (best_draft(costs, "prompt_lookup", acc, 8) or (0, 0.0))[0] > 0
    dear = _costs(1.0, {1: 3.0, 4: 9.0})  # another engine's costs, same acceptance
    assert best_draft(dear, "prompt_lookup", acc, 8) == (0, 0.0)


def test_costs_are_medians_a_delayed_step_hardly_moves() -> None:
    costs = _costs(1.0, {})
    for seconds in (1.0, 1.1, 40.0, 0.9, 1.0):  # one step the machine delayed
        costs.record_plain(seconds)
    assert costs.plain == pytest.approx(1.0)
    assert costs.mean("plain") > 7  # the report's mean keeps everything
    costs.record_draft("self", 3.0, 3)
    costs.record_draft("prompt_lookup", 0.02, 5)
    assert costs.draft_token == {"self": pytest.approx(1.0)} and costs.draft_call == {"prompt_lookup": 0.02}
    assert costs.step_cost("self", 2) is None  # no verify measured yet


def test_a_plain_step_is_due_until_three_are_measured_then_every_64_samples() -> None:
    costs = SpecCosts()
    for _ in range(3):
        assert costs.needs_plain()
        costs.record_plain(1.0)
    assert not costs.needs_plain()
    for _ in range(63):
        costs.record_verify(1.5, 2)
    assert not costs.needs_plain()
    costs.record_verify(1.5, 2)
    assert costs.needs_plain()


def test_a_plain_estimate_above_a_settled_verify_is_capped_and_measured_again() -> None:
    """Plain steps measured while something delayed them (the first use of a drafter, another job) left the
    plain estimate ~3x too high; plain steps were then taken once per 64, and the curve, never below the plain
    step, was flat from 0 to 4 drafts: drafting looked free and self-speculation ran at 0.39x. A verify does a
    plain step's work and more, so the plain step is read as at most the cheapest settled verify, and plain
    steps are taken every 4 until the estimate agrees."""
    costs = SpecCosts()
    for _ in range(3):
        costs.record_plain(3.0)  # delayed: the true plain step costs 1.0
    for _ in range(3):
        for k, seconds in ((1, 1.3), (4, 2.5), (7, 4.0)):
            costs.record_verify(seconds, k)
    costs.record_draft("self", 1.8, 3)  # 0.6 a draft token
    table = costs.verify_costs(7) or []
    assert table[0] == pytest.approx(1.3) and costs.plain_step() == pytest.approx(1.3)
    acc = Acceptance(8)
    for n in range(60):
        acc.record(7, n % 4)  # 0, 1, 2 or 3 of 7 hold
    k, _ = best_draft(costs, "self", acc, 7) or (0, 0.0)
    assert k <= 1  # with the base at 3.0 the flat curve made 3 drafts look worth it
    assert costs.needs_plain()  # 9 samples since the last plain one, and a verify below it
    for _ in range(4):
        costs.record_plain(1.0)
    assert costs.plain == pytest.approx(1.0) and costs.plain_step() == pytest.approx(1.0)
    costs.record_verify(1.3, 1)
    assert not costs.needs_plain()  # consistent again: back to one plain step in 64


def test_acceptance_per_position_and_the_chance_a_draft_prefix_survives() -> None:
    acc = Acceptance(8)
    assert acc.survival(2) == pytest.approx([0.5, 0.25])  # no evidence: even odds per position
    for _ in range(30):
        acc.record(4, 4)  # the first four always hold
    for _ in range(10):
        acc.record(6, 4)  # the fifth fails
    surv = acc.survival(6)
    assert surv[3] > 0.9 and surv[4] < 0.2 * surv[3]
    assert surv[5] < surv[4]  # no evidence past five: it leans on the position before
    assert acc.evidence == 40
    capped = Acceptance(4, cap=10)
    for _ in range(100):
        capped.record(1, 0)
    for _ in range(10):
        capped.record(1, 1)
    assert capped.tries[1] == pytest.approx(10) and capped.survival(1)[0] > 0.5  # old misses faded


def test_best_draft_weighs_expected_tokens_against_the_cost_curve() -> None:
    cheap = _costs(1.0, {1: 1.1, 4: 1.4, 8: 1.8, 16: 2.6})
    sure, never = Acceptance(16), Acceptance(16)
    for _ in range(50):
        sure.record(16, 16)
        never.record(4, 0)
    assert best_draft(SpecCosts(), "prompt_lookup", sure, 16) is None  # unmeasured
    k, gain = best_draft(cheap, "prompt_lookup", sure, 16) or (0, 0.0)
    assert k == 16 and gain == pytest.approx(17 * 50 / 51 - 1.6, abs=1.0)
    assert best_draft(cheap, "prompt_lookup", sure, 3) == (3, pytest.approx(sum((50 / 51) ** j for j in range(4))
                                                                             - 1.25, abs=0.05))
    assert best_draft(cheap, "prompt_lookup", never, 16) == (0, 0.0)
    half = Acceptance(16)
    for n in range(60):
        half.record(4, n % 2)  # every other draft fails at once, the rest at the second token
    assert best_draft(cheap, "prompt_lookup", half, 16) == (1, pytest.approx(0.4, abs=0.02))
    # a drafter whose token costs half a plain step: not at even odds, but when nearly everything holds
    costly = _costs(1.0, {1: 1.1, 4: 1.4, 8: 1.8}, draft_token=0.5)
    assert best_draft(costly, "self", half, 16) == (0, 0.0)
    k, _ = best_draft(costly, "self", sure, 16) or (0, 0.0)
    assert k > 4


def test_drafting_never_measured_alone_is_bounded_not_free() -> None:
    """A model drafter whose proposals all caught up first (the prompt, a pause) has no measured cost per draft
    token; read as 0 it looked free, and a drafter at a plain step's cost kept drafting at half speed. The
    whole call per draft token bounds it until drafting is measured alone."""
    sure = Acceptance(16)
    for _ in range(50):
        sure.record(4, 3)  # three of four hold
    costs = _costs(1.0, {1: 1.6, 4: 2.5})
    assert costs.draft_token_cost("self") == 0.0
    assert (best_draft(costs, "self", sure, 4) or (0, 0.0))[0] > 0  # nothing known of drafting: it drafts
    costs.record_draft_bound("self", 40.0, 4)  # 4 drafts after a 30-token catch-up: at most 10 a token
    costs.record_draft_bound("self", 90.0, 4)  # a longer catch-up: a looser bound, not kept
    assert costs.draft_token_cost("self") == 10.0 and "self" not in costs.draft_token
    assert best_draft(costs, "self", sure, 4) == (0, 0.0)  # bounded: not worth it
    costs.record_draft("self", 0.4, 4)  # then measured alone: 0.1 a token, which the bound no longer hides
    assert costs.draft_token_cost("self") == pytest.approx(0.1)
    assert (best_draft(costs, "self", sure, 4) or (0, 0.0))[0] > 0


def test_heuristic_length_grows_after_full_accepts_and_pauses_double() -> None:
    cfg = SpecConfig(initial_draft=4, max_draft=8, cooldown_tokens=10)
    st = SpecState("draft", cfg.initial_draft)
    st.record(4, 4, cfg)
    assert st.k == 6
    st.record(6, 6, cfg)
    st.record(8, 8, cfg)
    assert st.k == 8  # capped
    st.record(8, 1, cfg)
    assert st.k == 2 and st.acceptance_rate == pytest.approx(19 / 26)
    st.pause(30, cfg)
    assert not st.active(39) and st.active(40) and st.probing
    st.pause(40, cfg)
    assert not st.active(59) and st.active(60) and st.pauses == 2
    assert math.isnan(SpecState("draft", 1).acceptance_rate)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        SpecConfig(default="sometimes")
    with pytest.raises(ValueError):
        SpecConfig(initial_draft=20, max_draft=16)
    with pytest.raises(ValueError):
        SpecConfig(ngram_min=3, ngram_max=2)
