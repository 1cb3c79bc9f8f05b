"""The pipeline end to end over scripted upstreams (real registry, router and metering):
stage order, tiers, prompts between stages, parallel steps, repair/fallback, revise bounds,
accounting that adds up, review verdicts sent as classifier feedback."""

from __future__ import annotations

import pytest

from gateway.money import usd_to_nanos
from gateway.pipeline import RequestContext
from tests.gateway.routing_support import plan_of
from tests.gateway.scripted_models import (
    ScriptedProvider,
    harness,
    plan_json,
    raise_upstream,
    scripted_settings,
)

CTX = RequestContext(request_id="chatcmpl-test", tenant_id="t1", key_id="k1")
BODY = {"model": "auto", "messages": [{"role": "user", "content": "Compute 17*23 and then add 5."}]}
TWO_STEP = plan_json(("s1", "multiply 17 by 23", []), ("s2", "add 5 to the product", ["s1"]))
PARALLEL = plan_json(("a", "first half", []), ("b", "second half", []), ("c", "combine", ["a", "b"]))


def high(body: dict = BODY) -> object:
    return plan_of(harness(ScriptedProvider()).settings, {**body, "reasoning_effort": "high"}, None)


async def test_stage_order_tiers_and_prompts_between_stages() -> None:
    provider = ScriptedProvider(plans=[TWO_STEP], step=lambda m, t: "391" if "multiply" in t else "396",
                                reviews=["VERDICT: accept\nANSWER:\n17*23+5 = 396"])
    h = harness(provider)
    result = await h.pipeline.run(CTX, BODY, high())
    assert provider.roles() == ["plan", "step", "step", "review"]
    assert [c.model for c in provider.calls] == ["scripted/big", "scripted/small", "scripted/small", "scripted/big"]
    assert [c.options.experts_per_token for c in provider.calls] == [4, 1, 1, 4]
    # the request reaches the planner; plan steps reach the low tier; s1's output feeds s2
    assert "Compute 17*23" in provider.calls[0].user_text
    assert "multiply 17 by 23" in provider.calls[1].user_text
    assert "add 5 to the product" in provider.calls[2].user_text
    assert "Result of step s1:\n391" in provider.calls[2].user_text
    # the reviewer sees the request, the plan and both results
    review_prompt = provider.calls[3].user_text
    assert "Compute 17*23" in review_prompt and "Result: 391" in review_prompt and "Result: 396" in review_prompt
    assert result.answer == "17*23+5 = 396"
    assert result.verdict == "accept" and result.plan_source == "json"
    assert [(e.stage, e.tier) for e in h.entries] == [("plan", "high"), ("execute", "low"),
                                                       ("execute", "low"), ("review", "high")]
    assert all(e.request_id == "chatcmpl-test" and e.tenant_id == "t1" for e in h.entries)


async def test_independent_steps_run_in_parallel_and_feed_dependants() -> None:
    provider = ScriptedProvider(plans=[PARALLEL], step=lambda m, t: "half" if "half" in t else "whole",
                                step_delay_s=0.02)
    h = harness(provider)
    await h.pipeline.run(CTX, BODY, high())
    assert provider.max_in_flight_steps == 2  # a and b together; c after both
    combine = next(c for c in provider.calls if "combine" in c.user_text)
    assert "Result of step a:\nhalf" in combine.user_text and "Result of step b:\nhalf" in combine.user_text
    assert provider.calls.index(combine) == 3


async def test_invalid_plan_is_repaired_once() -> None:
    provider = ScriptedProvider(plans=['{"steps": [{"id": "s1", "instruction": "x", "depends_on": ["s9"]}]}',
                                       TWO_STEP])
    h = harness(provider)
    result = await h.pipeline.run(CTX, BODY, high())
    assert provider.roles() == ["plan", "plan", "step", "step", "review"]
    repair = provider.calls[1].body["messages"]
    assert repair[-2]["role"] == "assistant" and "s9" in repair[-2]["content"]
    assert "unknown step(s) s9" in repair[-1]["content"]
    assert result.plan_source == "json" and len(result.plan["steps"]) == 2


async def test_numbered_list_is_accepted_as_a_sequential_plan() -> None:
    provider = ScriptedProvider(plans=["Plan:\n1. find the product\n2. add five"])
    result = await harness(provider).pipeline.run(CTX, BODY, high())
    assert result.plan_source == "list"
    assert provider.roles() == ["plan", "step", "step", "review"]
    assert "Result of step s1" in provider.calls[2].user_text


async def test_unrepairable_plan_falls_back_to_a_direct_high_answer() -> None:
    provider = ScriptedProvider(plans=["no idea", "still no idea, on one line"], direct="direct high answer")
    h = harness(provider)
    result = await h.pipeline.run(CTX, BODY, high())
    assert provider.roles() == ["plan", "plan", "direct"]
    assert provider.calls[2].model == "scripted/big"
    assert provider.calls[2].body["messages"] == BODY["messages"]
    assert result.answer == "direct high answer" and result.plan_source == "fallback"
    assert [(e.stage, e.tier) for e in h.entries] == [("plan", "high"), ("plan", "high"), ("direct", "high")]
    assert h.verdicts == []  # no review, nothing to learn from


async def test_single_step_fallback_keeps_all_four_stages() -> None:
    provider = ScriptedProvider(plans=["no idea", "still no idea, on one line"], step=lambda m, t: "the step")
    h = harness(provider, scripted_settings(plan_fallback="single_step"))
    result = await h.pipeline.run(CTX, BODY, high())
    assert provider.roles() == ["plan", "plan", "step", "review"]
    assert "Answer the request." in provider.calls[2].user_text and "Compute 17*23" in provider.calls[2].user_text
    assert result.plan_source == "single_step" and result.verdict == "accept"
    assert [(e.stage, e.tier) for e in h.entries][2:] == [("execute", "low"), ("review", "high")]


async def test_revise_reruns_failing_steps_and_dependants_one_tier_up_bounded() -> None:
    provider = ScriptedProvider(plans=[PARALLEL], reviews=["VERDICT: revise\nFAILING: a\nANSWER:\ndraft"])
    h = harness(provider)
    result = await h.pipeline.run(CTX, BODY, high())
    # round 0: a, b, c on low; round 1: a, c on medium; round 2: a, c on high; then it stops (max 2)
    steps = [(c.model, c.user_text.split("Your step (")[1][0]) for c in provider.calls if c.role == "step"]
    assert sorted(steps[:3]) == [("scripted/small", "a"), ("scripted/small", "b"), ("scripted/small", "c")]
    assert steps[3:5] == [("scripted/mid", "a"), ("scripted/mid", "c")]
    assert steps[5:] == [("scripted/big", "a"), ("scripted/big", "c")]
    assert provider.roles().count("review") == 3
    assert result.review_rounds == 2 and result.verdict == "revise"
    assert "review still asked for revisions after 2 round(s)" in result.notes
    assert [e.tier for e in h.entries if e.stage == "execute"][3:] == ["medium", "medium", "high", "high"]
    assert h.verdicts[0].verdict == "revise" and h.verdicts[0].label_tier == "high"


async def test_accept_after_one_revision_labels_the_tier_that_sufficed() -> None:
    provider = ScriptedProvider(plans=[TWO_STEP], reviews=["VERDICT: revise\nFAILING: s2\nANSWER:\nx",
                                                           "VERDICT: accept\nANSWER:\nfixed"])
    h = harness(provider)
    result = await h.pipeline.run(CTX, BODY, high())
    assert result.answer == "fixed" and result.review_rounds == 1
    (verdict,) = h.verdicts
    assert (verdict.verdict, verdict.failing_steps, verdict.rounds, verdict.label_tier) == (
        "accept", ("s2",), 1, "medium")
    assert verdict.messages == tuple(BODY["messages"]) and verdict.allow_prompt_storage is False


async def test_a_review_without_a_verdict_is_not_sent_as_feedback() -> None:
    h = harness(ScriptedProvider(plans=[TWO_STEP], reviews=["just some prose from a weak reviewer"]))
    result = await h.pipeline.run(CTX, BODY, high())
    assert result.answer == "just some prose from a weak reviewer" and h.verdicts == []


async def test_ledger_rows_headers_and_response_add_up() -> None:
    provider = ScriptedProvider(plans=[TWO_STEP], failures=[raise_upstream()])  # plan's first try fails
    h = harness(provider)
    result = await h.pipeline.run(CTX, BODY, high())
    response = result.to_response(CTX.request_id, "auto", 1)
    assert [e.status for e in h.entries][:2] == ["error", "ok"]  # the retried attempt is a ledger row
    usage = response["usage"]
    assert usage["prompt_tokens"] == sum(e.usage.prompt_tokens for e in h.entries)
    assert usage["completion_tokens"] == sum(e.usage.completion_tokens for e in h.entries)
    review_tokens = h.entries[-1].usage.completion_tokens
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"] - review_tokens
    cost = sum(e.cost_nanos for e in h.entries)
    baseline = sum(e.baseline_cost_nanos for e in h.entries)
    assert usd_to_nanos(response["tiergate"]["cost_usd"]) == cost
    assert sum(usd_to_nanos(s["cost_usd"]) for s in response["tiergate"]["stages"]) == cost
    headers = result.headers()
    assert headers["x-tiergate-effort"] == "high"
    assert usd_to_nanos(headers["x-tiergate-cost-usd"]) == cost  # exact: nine decimals of USD
    assert usd_to_nanos(headers["x-tiergate-saved-usd"]) == baseline - cost
    assert baseline > cost > 0  # execute ran on the cheap tier
    # cost of each row is its tokens at its tier's price
    small = h.settings.models["small"].price
    for e in (e for e in h.entries if e.stage == "execute"):
        assert e.cost_nanos == small.nanos(e.usage.prompt_tokens, 0, e.usage.completion_tokens)


async def test_verbosity_bounds_answer_and_effort_bounds_thinking() -> None:
    provider = ScriptedProvider(plans=[TWO_STEP])
    h = harness(provider)
    ex = plan_of(h.settings, {**BODY, "reasoning_effort": "high", "verbosity": "low"}, None)
    await h.pipeline.run(CTX, BODY, ex)
    plan_call, step_call, review_call = provider.calls[0], provider.calls[1], provider.calls[-1]
    assert plan_call.body["max_tokens"] == 128  # high tier's thinking budget
    assert step_call.body["max_tokens"] == 64  # low tier's max output (under the thinking budget)
    assert review_call.body["max_tokens"] == 50 + 48  # 1/4 of 200 for the answer + verdict lines
    assert "Answer in a few sentences" in review_call.body["messages"][0]["content"]


async def test_client_sampling_settings_reach_every_stage() -> None:
    provider = ScriptedProvider(plans=[TWO_STEP])
    h = harness(provider)
    body = {**BODY, "temperature": 0, "top_p": 0.5, "user": "someone"}
    await h.pipeline.run(CTX, body, high(body))
    assert all((c.body["temperature"], c.body["top_p"]) == (0, 0.5) for c in provider.calls)
    assert all("user" not in c.body for c in provider.calls)


async def test_upstream_failure_after_retries_propagates_and_is_billed() -> None:
    from gateway.errors import UpstreamError

    provider = ScriptedProvider(failures=[raise_upstream(), raise_upstream()])
    h = harness(provider)
    with pytest.raises(UpstreamError):
        await h.pipeline.run(CTX, BODY, high())
    assert [e.status for e in h.entries] == ["error", "error"]
