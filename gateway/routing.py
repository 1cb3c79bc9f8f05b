"""Routing policy: which tier and model answer a request, and how — one ``decide`` per request,
made before admission. Pure functions of the settings and the request, no I/O.

``decide`` resolves the requested ``model``: a tier name (``low``) or ``tier-<name>``; a model
configured under ``models:`` (called directly, at its own price and output cap); or ``auto``:
the client's ``reasoning_effort``, else the classifier's decision (the ``DecideAuto`` hook), else
``routing.default_tier``. A tenant past its soft budget has its effort capped to
``budgets.soft_effort_cap``. The effort then picks the execution:

- none / minimal / low → one direct call to that tier (the fast path);
- medium → one call to the medium tier with its thinking budget;
- high / xhigh → the four-layer pipeline (xhigh adds multi-path execution with pruning).

A tier or model named by the client is a plain proxy call (its output cap applied) unless the
request asks for the pipeline, or the soft budget capped it. A request may force or forbid the
pipeline and cap its cost with ``extra_body={"tiergate": {"pipeline": "auto"|"on"|"off",
"max_cost_usd": 0.01}}``. Verbosity (low/medium/high) bounds the answer's length; effort bounds
thinking. The ``RouteDecision`` carries everything the rest of the request path needs: the tier
that runs, the model chain, the upstream body of a direct call, the plan and the price tier.

Imports only settings and errors: no providers, db, web framework or pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

from gateway.errors import InvalidRequest, ModelNotFound
from gateway.settings import TIER_NAMES, Settings, Tier

PipelineMode = Literal["auto", "on", "off"]
ExecutionMode = Literal["direct", "thinking", "pipeline"]
EffortSource = Literal["client", "classifier", "exploration", "default", "budget_cap"]
Verbosity = Literal["low", "medium", "high"]

AUTO_MODEL = "auto"
TIER_PREFIX = "tier-"
DIRECT_TIER = "direct"  # the tier label of a model called by name that no tier uses
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


def capped_effort(settings: Settings, tier: str, source: EffortSource, soft_budget_exceeded: bool) -> EffortChoice:
    """``tier`` as chosen by ``source``, or — for a tenant past its soft budget — capped to
    ``settings.budgets.soft_effort_cap`` instead of failing."""
    tier = _check_tier(tier, "tier")
    cap = settings.budgets.soft_effort_cap
    if soft_budget_exceeded and tier_rank(tier) > tier_rank(cap):
        return EffortChoice(tier=cap, source="budget_cap", capped_from=tier)
    return EffortChoice(tier=tier, source=source)


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


def direct_body(body: dict[str, Any], plan: ExecutionPlan) -> dict[str, Any]:
    """The upstream body for a direct/thinking call: gateway-only fields removed, output bounded by
    the answer budget plus (for medium) the thinking budget."""
    out = {k: v for k, v in body.items() if k not in ("tiergate", "verbosity", "reasoning_effort")}
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    out[key] = plan.max_answer_tokens + (plan.thinking_budget_tokens or 0)
    return out


# -- the one decision ---------------------------------------------------------------------------
class EffortVerdict(Protocol):
    """What the classifier hook returns for an ``auto`` request (``gateway.learning``'s
    ``RoutingVerdict``): the tier to run, the score, the classifier version, and — when the
    router explores — the probability with which this tier was chosen."""

    @property
    def tier(self) -> str: ...
    @property
    def score(self) -> float: ...
    @property
    def version(self) -> str: ...
    @property
    def propensity(self) -> float: ...
    @property
    def explored(self) -> bool: ...


@dataclass(frozen=True)
class RoutingPrefs:
    """A tenant's own routing settings (None: the configured ones): its exploration share, and a
    quality or cost target for the thresholds."""

    exploration: float | None = None
    target_quality: float | None = None
    target_cost: float | None = None


NO_PREFS = RoutingPrefs()

# (messages, tenant id, the tenant's routing settings) -> verdict
DecideAuto = Callable[[list[dict[str, Any]], str | None, RoutingPrefs], EffortVerdict]


@dataclass(frozen=True)
class RouteDecision:
    """How one request runs, decided once before admission (the budgets hold its worst case).
    ``tier`` is the effort that runs, after any soft-budget cap (``DIRECT_TIER`` for a model no
    tier uses); ``models`` the chain of its call (for a pipeline, the review tier's: its first
    call); ``body`` what a direct call sends upstream (for a pipeline: the client's request, which
    the stages build their calls from); ``plan`` None for a model named directly."""

    requested_model: str
    tier: str
    effort_source: EffortSource
    models: tuple[str, ...]
    body: dict[str, Any]
    plan: ExecutionPlan | None = None
    by_model: bool = False
    capped_from: str | None = None
    classifier_score: float | None = None
    classifier_version: str | None = None
    verdict: EffortVerdict | None = None  # the classifier's, when it chose the tier (logged for learning)

    @property
    def propensity(self) -> float:
        """The probability with which the routing policy chose this tier (1: not randomised)."""
        return 1.0 if self.verdict is None else float(self.verdict.propensity)

    @property
    def uses_pipeline(self) -> bool:
        return self.plan is not None and self.plan.uses_pipeline

    def price_tier(self, settings: Settings) -> str | None:
        """The tier whose prices bill this request's calls; None: each model's own price."""
        return None if self.by_model or self.tier not in settings.tiers else self.tier


def public_model_names(settings: Settings) -> list[str]:
    """Everything a client may put in ``model``: auto, one name per tier, every configured model."""
    return [AUTO_MODEL, *(TIER_PREFIX + t for t in TIER_NAMES), *settings.models]


def tier_for_model(settings: Settings, model_name: str) -> str:
    for name in TIER_NAMES:
        if settings.tiers[name].model == model_name:  # type: ignore[index]
            return name
    return DIRECT_TIER


def tier_models(settings: Settings, tier: str) -> tuple[str, ...]:
    t = settings.tiers[tier]  # type: ignore[index]
    return (t.model, *t.fallbacks)


def cap_output(body: dict[str, Any], cap: int | None) -> dict[str, Any]:
    """``body`` with its output-token field bounded by ``cap``; one field is forwarded
    (``max_completion_tokens`` when the client used it, else ``max_tokens``)."""
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if cap is None and asked is None:
        return body
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    out = {k: v for k, v in body.items() if k not in ("max_tokens", "max_completion_tokens")}
    out[key] = asked if cap is None else min(asked, cap) if asked is not None else cap
    return out


def _requested_effort(settings: Settings, requested: str, messages: list[dict[str, Any]],
                      reasoning_effort: str | None, decide_auto: DecideAuto | None, tenant: str | None,
                      prefs: RoutingPrefs) -> tuple[str, EffortSource, EffortVerdict | None]:
    """(tier, source, the classifier's verdict) of a request naming a tier or ``auto``."""
    if requested in TIER_NAMES:
        return requested, "client", None
    if requested.startswith(TIER_PREFIX) and requested[len(TIER_PREFIX):] in TIER_NAMES:
        return requested[len(TIER_PREFIX):], "client", None
    if requested != AUTO_MODEL:
        raise ModelNotFound(f"The model '{requested[:100]}' does not exist or you do not have access to it.",
                            param="model")
    if reasoning_effort in TIER_NAMES:
        return cast(str, reasoning_effort), "client", None
    if decide_auto is not None:
        verdict = decide_auto(messages, tenant, prefs)
        return verdict.tier, "exploration" if verdict.explored else "classifier", verdict
    return settings.routing.default_tier, "default", None


def decide(settings: Settings, requested: str, body: dict[str, Any], *, reasoning_effort: str | None = None,
           decide_auto: DecideAuto | None = None, soft_budget_exceeded: bool = False, tenant: str | None = None,
           prefs: RoutingPrefs = NO_PREFS) -> RouteDecision:
    """The route of one request (``body``: the validated request as forwardable JSON; ``tenant``
    and its routing ``prefs`` go to the classifier hook)."""
    messages: list[dict[str, Any]] = body["messages"]
    by_model = requested in settings.models and requested not in TIER_NAMES
    verdict: EffortVerdict | None = None
    if by_model:
        tier, source = tier_for_model(settings, requested), "client"
    else:
        tier, source, verdict = _requested_effort(settings, requested, messages, reasoning_effort, decide_auto,
                                                  tenant, prefs)
    if tier not in TIER_NAMES:  # a model no tier uses: a plain proxy call to it
        out = cap_output({k: v for k, v in body.items() if k != "tiergate"},
                         settings.models[requested].max_output_tokens)
        return RouteDecision(requested, tier, cast(EffortSource, source), (requested,), out, by_model=True)
    effort = capped_effort(settings, tier, cast(EffortSource, source), soft_budget_exceeded)
    capped = cap_output(body, settings.models[requested].max_output_tokens if by_model and not effort.capped_from
                        else settings.tiers[effort.tier].max_output_tokens)  # type: ignore[index]
    options = parse_tiergate_options(capped)
    if requested != AUTO_MODEL and options.pipeline == "auto":
        options = TiergateOptions(pipeline="off", max_cost_usd=options.max_cost_usd)
    plan = plan_execution(settings, effort, options, parse_verbosity(capped), client_max_tokens(capped),
                          pipeline_blocker(capped))
    common = {"effort_source": effort.source, "capped_from": effort.capped_from, "verdict": verdict,
              "classifier_score": None if verdict is None else float(verdict.score),
              "classifier_version": None if verdict is None else verdict.version}
    if requested != AUTO_MODEL and effort.capped_from is None and not plan.uses_pipeline:
        out = {k: v for k, v in capped.items() if k != "tiergate"}  # what the client asked, as a proxy
        chain = (requested,) if by_model else tier_models(settings, effort.tier)
        return RouteDecision(requested, effort.tier, models=chain, body=out, plan=plan, by_model=by_model,
                             **common)  # type: ignore[arg-type]
    direct = capped if plan.uses_pipeline else direct_body(capped, plan)
    return RouteDecision(requested, effort.tier, models=tier_models(settings, plan.tier), body=direct, plan=plan,
                         **common)  # type: ignore[arg-type]
