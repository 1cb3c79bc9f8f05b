"""Routing policy: effort tier → how a request is executed. Pure functions, no I/O.

Decides (1) the effort tier from the client's ``reasoning_effort``, the classifier's
decision and the tenant's soft budget, and (2) the execution plan for that effort:

- none / minimal / low → one direct call to that tier (the fast path);
- medium → one call to the medium tier with its thinking budget;
- high / xhigh → the four-layer pipeline (xhigh adds multi-path execution with pruning).

A request may force or forbid the pipeline and cap its cost with
``extra_body={"tiergate": {"pipeline": "auto"|"on"|"off", "max_cost_usd": 0.01}}``.
Verbosity (low/medium/high) bounds the final answer's length; effort bounds thinking.

Imports only settings and errors: no providers, db, web framework or pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

from gateway.errors import InvalidRequest
from gateway.settings import TIER_NAMES, Settings, Tier

PipelineMode = Literal["auto", "on", "off"]
ExecutionMode = Literal["direct", "thinking", "pipeline"]
EffortSource = Literal["client", "classifier", "default", "budget_cap"]
Verbosity = Literal["low", "medium", "high"]

DEFAULT_EFFORT: Tier = "low"
VERBOSITY_FRACTION: dict[str, float] = {"low": 0.25, "medium": 0.5, "high": 1.0}
MIN_ANSWER_TOKENS = 16
PIPELINE_TIERS: frozenset[str] = frozenset({"high", "xhigh"})


@dataclass(frozen=True)
class TiergateOptions:
    """The ``tiergate`` extension object of a request body."""

    pipeline: PipelineMode = "auto"
    max_cost_usd: float | None = None


@dataclass(frozen=True)
class EffortChoice:
    tier: Tier
    source: EffortSource
    capped_from: Tier | None = None  # the effort before the soft-budget cap, when capped


@dataclass(frozen=True)
class ExecutionPlan:
    """What the gateway will do with one request. ``tier`` answers direct/thinking requests;
    pipelines plan and review on ``review_tier`` and execute on ``execute_tier``."""

    effort: Tier
    effort_source: EffortSource
    mode: ExecutionMode
    tier: Tier
    max_answer_tokens: int
    thinking_budget_tokens: int | None
    execute_tier: Tier = "low"
    review_tier: Tier = "high"
    paths: int = 1
    max_cost_usd: float | None = None
    capped_from: Tier | None = None
    verbosity: Verbosity | None = None

    @property
    def uses_pipeline(self) -> bool:
        return self.mode == "pipeline"


def tier_rank(tier: str) -> int:
    return TIER_NAMES.index(tier)


def tier_above(tier: str) -> Tier:
    """The next tier up (xhigh stays xhigh)."""
    return cast(Tier, TIER_NAMES[min(tier_rank(tier) + 1, len(TIER_NAMES) - 1)])


def _check_tier(value: Any, param: str) -> Tier:
    if value not in TIER_NAMES:
        raise InvalidRequest(f"{param} must be one of {', '.join(TIER_NAMES)}; got {value!r}", param=param)
    return cast(Tier, value)


def parse_tiergate_options(body: dict[str, Any]) -> TiergateOptions:
    """Read and validate ``body["tiergate"]`` (what the OpenAI SDK's ``extra_body`` sends)."""
    raw = body.get("tiergate")
    if raw is None:
        return TiergateOptions()
    if not isinstance(raw, dict):
        raise InvalidRequest("tiergate must be an object", param="tiergate")
    mode = raw.get("pipeline", "auto")
    if mode is True:
        mode = "on"
    elif mode is False:
        mode = "off"
    if mode not in ("auto", "on", "off"):
        raise InvalidRequest("tiergate.pipeline must be auto, on or off", param="tiergate.pipeline")
    cap = raw.get("max_cost_usd")
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int | float) or cap <= 0:
            raise InvalidRequest("tiergate.max_cost_usd must be a positive number",
                                 param="tiergate.max_cost_usd")
        cap = float(cap)
    return TiergateOptions(pipeline=cast(PipelineMode, mode), max_cost_usd=cap)


def parse_verbosity(body: dict[str, Any]) -> Verbosity | None:
    value = body.get("verbosity")
    if value is None:
        return None
    if value not in VERBOSITY_FRACTION:
        raise InvalidRequest("verbosity must be low, medium or high", param="verbosity")
    return cast(Verbosity, value)


def decide_effort(requested: str | None, classifier_tier: str | None, *, soft_budget_exceeded: bool,
                  settings: Settings) -> EffortChoice:
    """The client's ``reasoning_effort`` wins, then the classifier, then the default; a tenant
    past its soft budget is capped to ``settings.budgets.soft_effort_cap`` instead of failing."""
    if requested is not None:
        tier, source = _check_tier(requested, "reasoning_effort"), "client"
    elif classifier_tier is not None:
        tier, source = _check_tier(classifier_tier, "classifier_tier"), "classifier"
    else:
        tier, source = DEFAULT_EFFORT, "default"
    cap = settings.budgets.soft_effort_cap
    if soft_budget_exceeded and tier_rank(tier) > tier_rank(cap):
        return EffortChoice(tier=cap, source="budget_cap", capped_from=tier)
    return EffortChoice(tier=tier, source=cast(EffortSource, source))


def max_answer_tokens(settings: Settings, tier: str, verbosity: Verbosity | None,
                      client_max_tokens: int | None) -> int:
    """Verbosity scales the tier's ``max_output_tokens``; a client ``max_tokens`` caps it further."""
    limit = settings.tiers[cast(Tier, tier)].max_output_tokens
    if verbosity is not None:
        limit = max(MIN_ANSWER_TOKENS, int(limit * VERBOSITY_FRACTION[verbosity]))
    if client_max_tokens is not None:
        limit = min(limit, client_max_tokens)
    return max(1, limit)


def client_max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest("max_tokens must be a positive integer", param="max_tokens")
    return value


PIPELINE_BLOCKERS: tuple[tuple[str, str], ...] = (
    ("tools", "tools"), ("functions", "functions"), ("response_format", "response_format"),
    ("logprobs", "logprobs"), ("audio", "audio"))


def pipeline_blocker(body: dict[str, Any]) -> str | None:
    """Why a request cannot run through the pipeline (its answer is composed text), if it cannot:
    tool calls, structured output formats, logprobs, audio, or several choices."""
    for key, name in PIPELINE_BLOCKERS:
        value = body.get(key)
        if value and not (key == "response_format" and isinstance(value, dict) and value.get("type") == "text"):
            return name
    if (body.get("n") or 1) != 1:
        return "n > 1"
    return None


def plan_execution(settings: Settings, effort: EffortChoice, options: TiergateOptions,
                   verbosity: Verbosity | None = None, client_max: int | None = None,
                   blocker: str | None = None) -> ExecutionPlan:
    """Map an effort decision onto direct / thinking / pipeline execution. A request the pipeline
    cannot serve (``blocker``) gets a single thinking call instead, or a 400 if it forced the pipeline."""
    tier = effort.tier
    if blocker is not None and options.pipeline == "on":
        raise InvalidRequest(f"tiergate.pipeline=on cannot be combined with {blocker}", param="tiergate.pipeline")
    if options.pipeline == "on" and effort.source != "budget_cap":
        mode: ExecutionMode = "pipeline"
    elif options.pipeline == "off" or tier not in PIPELINE_TIERS or blocker is not None:
        mode = "thinking" if tier_rank(tier) >= tier_rank("medium") else "direct"
    else:
        mode = "pipeline"
    if mode == "pipeline":
        review_tier: Tier = "xhigh" if tier == "xhigh" else "high"
        answer_tier: Tier = review_tier
    else:
        review_tier = "high"
        answer_tier = tier
    knobs = settings.tiers[answer_tier].engine
    thinking = knobs.thinking_budget_tokens if mode != "direct" else None
    paths = settings.pipeline.xhigh_paths if (mode == "pipeline" and tier == "xhigh") else 1
    return ExecutionPlan(
        effort=tier, effort_source=effort.source, mode=mode, tier=answer_tier,
        max_answer_tokens=max_answer_tokens(settings, answer_tier, verbosity, client_max),
        thinking_budget_tokens=thinking, execute_tier="low", review_tier=review_tier, paths=paths,
        max_cost_usd=options.max_cost_usd, capped_from=effort.capped_from, verbosity=verbosity)


def resolve_execution(settings: Settings, body: dict[str, Any], classifier_tier: str | None, *,
                      soft_budget_exceeded: bool = False) -> ExecutionPlan:
    """Everything above in one call, from a chat-completions request body."""
    effort = decide_effort(body.get("reasoning_effort"), classifier_tier,
                           soft_budget_exceeded=soft_budget_exceeded, settings=settings)
    return plan_execution(settings, effort, parse_tiergate_options(body), parse_verbosity(body),
                          client_max_tokens(body), pipeline_blocker(body))


def direct_body(body: dict[str, Any], plan: ExecutionPlan) -> dict[str, Any]:
    """The upstream body for a direct/thinking call: gateway-only fields removed, output bounded by
    the answer budget plus (for medium) the thinking budget."""
    out = {k: v for k, v in body.items() if k not in ("tiergate", "verbosity", "reasoning_effort")}
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    out[key] = plan.max_answer_tokens + (plan.thinking_budget_tokens or 0)
    return out
