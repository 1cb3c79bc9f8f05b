"""How requests are routed and paid for: budget defaults, routing, the effort classifier, the
pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from gateway.settings.base import Tier, _Strict


class BudgetDefaults(_Strict):
    period: Literal["day", "week", "month", "total"] = "month"
    limit_usd: float | None = Field(None, ge=0)
    soft_limit_fraction: float = Field(0.8, gt=0, le=1)
    alert_thresholds: tuple[float, ...] = (0.5, 0.8, 1.0)
    soft_effort_cap: Tier = "medium"
    reservation_lease_s: float = Field(300.0, gt=0)
    alert_webhook_env: str | None = None
    requests_per_min: int | None = Field(None, gt=0)  # per-tenant default rate limits
    tokens_per_min: int | None = Field(None, gt=0)
    # While Redis is unreachable (gateway/budgets/outage.py): fail_closed refuses what needs the
    # shared counters with a 503 + retry-after; fail_open_to_local counts in each replica, which
    # enforces redis_outage_local_share of every limit (1/N with N replicas: no joint overshoot).
    redis_outage: Literal["fail_closed", "fail_open_to_local"] = "fail_closed"
    redis_outage_local_share: float = Field(1.0, gt=0, le=1)


class RoutingSettings(_Strict):
    """How ``model: "auto"`` is routed and learned (README "Routing on outcomes").

    ``default_tier``: used when no ``reasoning_effort`` is given and no classifier is loaded.
    ``exploration``: the share of classifier-routed requests sent to a uniformly random tier
    instead (billed as usual, recorded with ``effort_source: exploration`` and the propensity of
    the tier that ran); a tenant's own share (``tiergate tenants set --exploration``) wins.
    ``decision_log``: which decisions are stored with their hashed features for learning.
    ``learn_*``: the off-policy learner (``tiergate routing learn``): the held-back share of new
    outcomes its update must not score worse on, the least number of new outcomes per update,
    the step size of per-tenant corrections (0: one global router)."""

    default_tier: Tier = "low"
    # A target for the thresholds instead of classifier.target_mix's strong share: keep at least
    # this share of the all-strong quality (measured on outcomes), or spend at most this share of
    # the all-strong cost. Per tenant: tiergate tenants set --target-quality / --target-cost.
    target_quality: float | None = Field(None, gt=0, le=1)
    target_cost: float | None = Field(None, gt=0, le=1)
    exploration: float = Field(0.02, ge=0, le=1)
    decision_log: Literal["all", "explored", "none"] = "all"
    learn_holdback: float = Field(0.2, gt=0, lt=1)
    learn_min_records: int = Field(200, ge=10)
    tenant_adaptation: float = Field(0.05, ge=0, le=1)

    @model_validator(mode="after")
    def _one_target(self) -> RoutingSettings:
        if self.target_quality is not None and self.target_cost is not None:
            raise ValueError("set routing.target_quality or routing.target_cost, not both")
        return self


CLASSIFIER_CURRENT_NAME = "effort.skops"  # the learner's published artifact, in ``classifier.feedback_dir``
INSTALL_ROOT = Path(__file__).resolve().parents[2]  # the tiergate checkout: engine/models, classifier/artifacts


class ClassifierSettings(_Strict):
    artifact: str = "classifier/artifacts/effort.skops"
    feedback_dir: str = "var/classifier"
    # true: `tiergate serve` / `worker` refuse to start without an artifact (the shipped config.yaml);
    # false: model "auto" without one routes to routing.default_tier (a warning at start)
    required: bool = False
    target_mix: dict[str, float] = {"low": 0.70, "medium": 0.20, "high": 0.10}
    store_prompt_text: bool = False
    reload_interval_s: float = Field(5.0, gt=0)


class PipelineSettings(_Strict):
    max_review_rounds: int = Field(2, ge=0)
    xhigh_paths: int = Field(3, ge=1)
    prune_after_tokens: int = Field(32, ge=1)
    max_steps: int = Field(6, ge=1)
    # When the planner gives no valid plan even after one repair: answer directly on the high tier
    # ("direct"), or run the whole request as one step so plan/execute/review still run ("single_step").
    plan_fallback: Literal["direct", "single_step"] = "direct"
