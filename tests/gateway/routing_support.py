"""The execution plan production routing makes (``gateway.routing.decide``), for pipeline tests
that need one: ``plan_of(settings, body, classifier_tier)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.routing import ExecutionPlan, RouteDecision, decide
from gateway.settings import Settings


@dataclass(frozen=True)
class Verdict:
    tier: str
    score: float = 0.5
    version: str = "test"
    propensity: float = 1.0
    explored: bool = False


def decision_of(settings: Settings, body: dict[str, Any], classifier_tier: str | None = None, *,
                soft_budget_exceeded: bool = False) -> RouteDecision:
    """``body``: a request (``model`` defaults to auto) as the wire model forwards it."""
    wire = {k: v for k, v in body.items() if k != "model"}
    return decide(settings, body.get("model", "auto"), wire, reasoning_effort=body.get("reasoning_effort"),
                  decide_auto=(lambda _m, _t, _e: Verdict(classifier_tier)) if classifier_tier else None,
                  soft_budget_exceeded=soft_budget_exceeded)


def plan_of(settings: Settings, body: dict[str, Any], classifier_tier: str | None = None, *,
            soft_budget_exceeded: bool = False) -> ExecutionPlan:
    plan = decision_of(settings, body, classifier_tier, soft_budget_exceeded=soft_budget_exceeded).plan
    assert plan is not None
    return plan
