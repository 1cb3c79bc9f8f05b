"""Routing policy, through the one ``decide`` production uses: effort precedence, soft-budget
cap, execution mode per tier, the tiergate extension object, verbosity → answer budget, named
tiers and models as plain proxy calls with their output caps."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest, ModelNotFound
from gateway.routing import (
    TiergateOptions,
    capped_effort,
    decide,
    direct_body,
    parse_tiergate_options,
    plan_execution,
    tier_above,
)
from gateway.schemas import parse_chat_request
from tests.gateway.routing_support import decision_of
from tests.gateway.routing_support import plan_of as resolve_execution
from tests.gateway.scripted_models import scripted_settings

S = scripted_settings()
MSGS = [{"role": "user", "content": "hi"}]


def test_client_effort_beats_classifier_beats_default() -> None:
    body = {"messages": MSGS}
    client = decision_of(S, {**body, "reasoning_effort": "high"}, "low")
    assert (client.tier, client.effort_source) == ("high", "client")
    classified = decision_of(S, body, "medium")
    assert (classified.tier, classified.effort_source, classified.classifier_version) == ("medium", "classifier",
                                                                                          "test")
    default = decision_of(S, body)
    assert (default.tier, default.effort_source) == (S.routing.default_tier, "default") == ("low", "default")


def test_soft_budget_caps_effort_instead_of_failing() -> None:
    capped = decision_of(S, {"messages": MSGS, "reasoning_effort": "xhigh"}, soft_budget_exceeded=True)
    assert (capped.tier, capped.effort_source, capped.capped_from) == ("medium", "budget_cap", "xhigh")
    assert capped.models == (S.tiers["medium"].model, *S.tiers["medium"].fallbacks)  # held and run on medium
    # below the cap nothing changes
    assert decision_of(S, {"messages": MSGS, "reasoning_effort": "low"}, soft_budget_exceeded=True
                       ).effort_source == "client"
    assert capped_effort(S, "xhigh", "classifier", True).capped_from == "xhigh"
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
    with pytest.raises(InvalidRequest):  # the wire model refuses it before routing
        parse_chat_request({"model": "auto", "messages": MSGS, "reasoning_effort": "huge"})
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
    ex = plan_execution(S, capped_effort(S, "medium", "client", False), TiergateOptions(), "low")
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


def test_named_tiers_and_models_are_plain_proxy_calls_with_their_caps() -> None:
    body = {"messages": MSGS, "verbosity": "low", "max_tokens": 10**6}
    tier = decide(S, "tier-high", body)
    assert not tier.uses_pipeline and tier.tier == "high" and tier.effort_source == "client"
    assert tier.body == {**body, "max_tokens": S.tiers["high"].max_output_tokens}  # verbosity kept, cap applied
    model = S.tiers["low"].model
    named = decide(S, model, {"messages": MSGS})
    assert named.by_model and named.models == (model,) and named.price_tier(S) is None
    with pytest.raises(ModelNotFound):
        decide(S, "gpt-unknown", {"messages": MSGS})
