"""Cost caps and budget-aware effort: the pipeline stops early with the best answer so far and
says so; a tenant past its soft budget gets capped effort, not a pipeline."""

from __future__ import annotations

from gateway.money import usd_to_nanos
from gateway.pipeline import RequestContext
from tests.gateway.routing_support import plan_of
from tests.gateway.scripted_models import ScriptedProvider, harness, plan_json

CTX = RequestContext(request_id="chatcmpl-b", tenant_id="t1", key_id="k1")
MSGS = [{"role": "user", "content": "Explain it step by step."}]
PLAN = plan_json(("s1", "first", []), ("s2", "second", ["s1"]))


def body(cap: float) -> dict:
    return {"model": "auto", "reasoning_effort": "high", "messages": MSGS, "tiergate": {"max_cost_usd": cap}}


async def _run_uncapped() -> int:
    h = harness(ScriptedProvider(plans=[PLAN]))
    result = await h.pipeline.run(CTX, body(1.0), plan_of(h.settings, body(1.0), None))
    assert result.stopped_early is None
    return result.cost_nanos


async def test_cap_before_review_returns_step_results_and_says_so() -> None:
    full = await _run_uncapped()  # about $0.0011 with these scripts
    h = harness(ScriptedProvider(plans=[PLAN], step=lambda m, t: "STEP2" if "second" in t else "STEP1"))
    # Each call is checked at its worst case (max_tokens at full price): the plan's is about
    # $0.0024, the review's about $0.0031 on top of the ~$0.0007 already spent.
    cap = 0.003
    assert usd_to_nanos(cap) > full
    result = await h.pipeline.run(CTX, body(cap), plan_of(h.settings, body(cap), None))
    assert [e.stage for e in h.entries] == ["plan", "execute", "execute"]
    assert result.stopped_early is not None and result.stopped_early["stage"] == "review"
    assert result.answer.startswith("STEP2")  # the plan's final step is the best answer so far
    assert "Stopped early" in result.answer and result.cost_nanos <= usd_to_nanos(cap)
    assert result.tiergate_object()["stopped_early"]["reason"] == "cost_cap"
    assert h.verdicts == []


async def test_cap_too_small_for_a_plan_answers_on_the_low_tier() -> None:
    h = harness(ScriptedProvider(direct="cheap answer"))
    ex = plan_of(h.settings, body(1e-4), None)
    result = await h.pipeline.run(CTX, body(1e-4), ex)
    assert [(e.stage, e.tier) for e in h.entries] == [("direct", "low")]
    assert result.answer.startswith("cheap answer") and "cost cap of $0.000100" in result.answer
    assert result.stopped_early["stage"] == "plan"  # type: ignore[index]
    assert result.cost_nanos <= usd_to_nanos("0.0001")


async def test_cap_is_never_exceeded_by_revise_rounds() -> None:
    h = harness(ScriptedProvider(plans=[PLAN], reviews=["VERDICT: revise\nFAILING: s1\nANSWER:\nfirst draft"]))
    cap = 0.0045  # room for the first review and some re-runs, not for every round
    result = await h.pipeline.run(CTX, body(cap), plan_of(h.settings, body(cap), None))
    assert result.stopped_early is not None and result.cost_nanos <= usd_to_nanos(cap)
    assert result.verdict == "revise" and result.answer.startswith("first draft")  # last composed answer
    assert 1 <= [e.stage for e in h.entries].count("review") <= 2


async def test_soft_budget_caps_a_high_request_to_a_single_medium_call() -> None:
    h = harness(ScriptedProvider())
    ex = plan_of(h.settings, {"messages": MSGS, "reasoning_effort": "high"}, None,
                           soft_budget_exceeded=True)
    assert (ex.mode, ex.tier, ex.effort_source, ex.capped_from) == ("thinking", "medium", "budget_cap", "high")
