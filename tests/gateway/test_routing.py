"""Routing policy: effort precedence, soft-budget cap, execution mode per tier, the tiergate
extension object, verbosity → answer budget."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest
from gateway.routing import (
    TiergateOptions,
    decide_effort,
    direct_body,
    parse_tiergate_options,
    plan_execution,
    resolve_execution,
    tier_above,
)
from tests.gateway.scripted_models import scripted_settings

S = scripted_settings()
MSGS = [{"role": "user", "content": "hi"}]


def test_client_effort_beats_classifier_beats_default() -> None:
    assert decide_effort("high", "low", soft_budget_exceeded=False, settings=S).source == "client"
    assert decide_effort(None, "medium", soft_budget_exceeded=False, settings=S).tier == "medium"
    choice = decide_effort(None, None, soft_budget_exceeded=False, settings=S)
    assert (choice.tier, choice.source) == ("low", "default")


def test_soft_budget_caps_effort_instead_of_failing() -> None:
    choice = decide_effort("xhigh", None, soft_budget_exceeded=True, settings=S)
    assert (choice.tier, choice.source, choice.capped_from) == ("medium", "budget_cap", "xhigh")
    # below the cap nothing changes
    assert decide_effort("low", None, soft_budget_exceeded=True, settings=S).source == "client"
    capped = resolve_execution(S, {"messages": MSGS, "reasoning_effort": "high",
                                   "tiergate": {"pipeline": "on"}}, None, soft_budget_exceeded=True)
    assert (capped.mode, capped.tier, capped.capped_from) == ("thinking", "medium", "high")


@pytest.mark.parametrize(("effort", "mode", "tier"), [
    ("none", "direct", "none"), ("minimal", "direct", "minimal"), ("low", "direct", "low"),
    ("medium", "thinking", "medium"), ("high", "pipeline", "high"), ("xhigh", "pipeline", "xhigh")])
def test_mode_per_effort(effort: str, mode: str, tier: str) -> None:
    ex = resolve_execution(S, {"messages": MSGS, "reasoning_effort": effort}, None)
    assert (ex.mode, ex.tier) == (mode, tier)
    assert ex.paths == (3 if effort == "xhigh" else 1)
    assert ex.thinking_budget_tokens == {"medium": 64, "high": 128, "xhigh": 256}.get(effort)


def test_pipeline_can_be_forced_or_forbidden() -> None:
    on = resolve_execution(S, {"messages": MSGS, "tiergate": {"pipeline": "on"}}, "low")
    assert (on.mode, on.execute_tier, on.review_tier) == ("pipeline", "low", "high")
    off = resolve_execution(S, {"messages": MSGS, "tiergate": {"pipeline": "off"}}, "high")
    assert (off.mode, off.tier) == ("thinking", "high")


def test_tiergate_options_are_validated() -> None:
    assert parse_tiergate_options({}) == TiergateOptions()
    assert parse_tiergate_options({"tiergate": {"max_cost_usd": 0.5}}).max_cost_usd == 0.5
    for bad in ({"pipeline": "maybe"}, {"max_cost_usd": -1}, {"max_cost_usd": "1"}, "on"):
        with pytest.raises(InvalidRequest) as err:
            parse_tiergate_options({"tiergate": bad})
        assert err.value.status == 400 and (err.value.param or "").startswith("tiergate")
    with pytest.raises(InvalidRequest):
        resolve_execution(S, {"messages": MSGS, "reasoning_effort": "huge"}, None)
    with pytest.raises(InvalidRequest):
        resolve_execution(S, {"messages": MSGS, "verbosity": "chatty"}, None)


def test_verbosity_and_client_max_tokens_bound_the_answer() -> None:
    budgets = [resolve_execution(S, {"messages": MSGS, "reasoning_effort": "high", "verbosity": v}, None)
               .max_answer_tokens for v in ("low", "medium", "high")]
    assert budgets == [50, 100, 200]
    assert resolve_execution(S, {"messages": MSGS, "reasoning_effort": "high"}, None).max_answer_tokens == 200
    capped = resolve_execution(S, {"messages": MSGS, "reasoning_effort": "high", "max_tokens": 30}, None)
    assert capped.max_answer_tokens == 30


def test_direct_body_strips_gateway_fields_and_adds_thinking_budget() -> None:
    ex = plan_execution(S, decide_effort("medium", None, soft_budget_exceeded=False, settings=S),
                        TiergateOptions(), "low")
    body = direct_body({"messages": MSGS, "tiergate": {"pipeline": "off"}, "verbosity": "low",
                        "reasoning_effort": "medium", "temperature": 0.2}, ex)
    assert body == {"messages": MSGS, "temperature": 0.2, "max_tokens": 32 + 64}


def test_tier_above() -> None:
    assert [tier_above(t) for t in ("low", "medium", "high", "xhigh")] == ["medium", "high", "xhigh", "xhigh"]


def test_requests_the_pipeline_cannot_compose_get_one_thinking_call() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    ex = resolve_execution(S, {"messages": MSGS, "reasoning_effort": "high", "tools": tools}, None)
    assert (ex.mode, ex.tier) == ("thinking", "high")
    text = resolve_execution(S, {"messages": MSGS, "reasoning_effort": "high",
                                 "response_format": {"type": "text"}}, None)
    assert text.mode == "pipeline"
    for extra in ({"tools": tools}, {"response_format": {"type": "json_object"}}, {"n": 2}, {"logprobs": True}):
        with pytest.raises(InvalidRequest) as err:
            resolve_execution(S, {"messages": MSGS, "tiergate": {"pipeline": "on"}, **extra}, None)
        assert err.value.param == "tiergate.pipeline"
