"""``PipelineExecutor``: the chat route's ``Executor`` (gateway.execution) with the routing policy
applied. For ``model: auto`` the effort (``reasoning_effort`` or the classifier) decides:
high/xhigh run the four-layer ``Pipeline``, lower efforts go to the wrapped direct executor with
gateway-only fields stripped and the answer/thinking budgets applied. A client that names a
tier (``tier-high``) or a model gets that model directly, like a plain proxy, unless it asks
for the pipeline with ``tiergate.pipeline: on``. Pipeline calls are written to the ledger one row per upstream
attempt and summed into the request's tally (which the chat flow records and streams as usage).
With budgets in front (``req.call_budget``) the pipeline holds every call's worst case on the
budgets before making it; the tenant's ``allow_prompt_storage`` reaches the review feedback.

Imports the execution hook, routing, ledger entries and the pipeline; never FastAPI/Starlette.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

from gateway.execution import Executor, LedgerSink, ResolvedRequest
from gateway.ledger.entries import LedgerEntry
from gateway.pipeline.runner import Pipeline
from gateway.pipeline.types import Clock, FeedbackSink, RequestContext
from gateway.providers.registry import ProviderRegistry
from gateway.providers.router import call_tier, stream_tier
from gateway.resolve import AUTO_MODEL
from gateway.routing import (
    EffortChoice,
    EffortSource,
    ExecutionPlan,
    client_max_tokens,
    decide_effort,
    direct_body,
    parse_tiergate_options,
    parse_verbosity,
    pipeline_blocker,
    plan_execution,
)
from gateway.settings import TIER_NAMES, Settings

# Is this request's tenant/key past its soft budget? e.g. ``(await budgets.status(principal)).soft_exceeded``
SoftBudgetCheck = Callable[[ResolvedRequest], Awaitable[bool]]


class PipelineExecutor:
    def __init__(self, settings: Settings, registry: ProviderRegistry, ledger: LedgerSink, direct: Executor,
                 *, feedback_sink: FeedbackSink | None = None, soft_budget_exceeded: SoftBudgetCheck | None = None,
                 clock: Clock = time.time) -> None:
        self.settings, self.registry, self.ledger, self.direct = settings, registry, ledger, direct
        self.feedback_sink, self.soft_budget_exceeded, self.clock = feedback_sink, soft_budget_exceeded, clock

    async def execution(self, req: ResolvedRequest) -> ExecutionPlan | None:
        """The routing decision for a resolved request; None for a model named directly."""
        tier = req.resolution.tier
        if tier not in TIER_NAMES:
            return None
        soft = bool(self.soft_budget_exceeded and await self.soft_budget_exceeded(req))
        source = cast(EffortSource, req.resolution.effort_source)
        if soft:
            effort = decide_effort(tier, None, soft_budget_exceeded=True, settings=self.settings)
            effort = dataclasses.replace(effort, source="budget_cap" if effort.capped_from else source)
        else:
            effort = EffortChoice(tier=cast(Any, tier), source=source)
        body = req.body
        options = parse_tiergate_options(body)
        req.tally.effort = effort.tier
        req.tally.effort_source = effort.source
        if req.resolution.requested_model != AUTO_MODEL and options.pipeline == "auto":
            options = dataclasses.replace(options, pipeline="off")
        return plan_execution(self.settings, effort, options, parse_verbosity(body), client_max_tokens(body),
                              pipeline_blocker(body))

    def _direct_request(self, req: ResolvedRequest, ex: ExecutionPlan | None) -> ResolvedRequest:
        if ex is None or (req.resolution.requested_model != AUTO_MODEL and ex.capped_from is None):
            body = {k: v for k, v in req.body.items() if k != "tiergate"}  # a plain proxy call
            return dataclasses.replace(req, body=body)
        tier = self.settings.tiers[ex.tier]
        resolution = dataclasses.replace(req.resolution, tier=ex.tier, models=(tier.model, *tier.fallbacks))
        return dataclasses.replace(req, resolution=resolution, body=direct_body(req.body, ex))

    def _pipeline(self, req: ResolvedRequest) -> Pipeline:
        def record(entry: LedgerEntry) -> None:
            self.ledger.record(entry)  # never swallowed: the money path fails loudly
            t = req.tally
            t.usage, t.cost_nanos = t.usage + entry.usage, t.cost_nanos + entry.cost_nanos
            t.baseline_cost_nanos += entry.baseline_cost_nanos
            t.calls += 1
            t.model = entry.model

        return Pipeline(self.settings, functools.partial(call_tier, self.registry, self.settings), record,
                        self.feedback_sink, self.clock, functools.partial(stream_tier, self.registry, self.settings),
                        req.call_budget)

    @staticmethod
    async def _start(req: ResolvedRequest) -> None:
        req.tally.pipeline = True
        if req.call_budget is not None:
            await req.call_budget.meter_per_call()  # many calls: each holds its own worst case

    @staticmethod
    def _context(req: ResolvedRequest) -> RequestContext:
        return RequestContext(request_id=req.request_id, tenant_id=req.tenant_id, key_id=req.key_id,
                              allow_prompt_storage=req.allow_prompt_storage)

    async def complete(self, req: ResolvedRequest) -> dict[str, Any]:
        ex = await self.execution(req)
        if ex is None or not ex.uses_pipeline:
            return await self.direct.complete(self._direct_request(req, ex))
        await self._start(req)
        result = await self._pipeline(req).run(self._context(req), req.body, ex)
        return result.to_response(req.request_id, req.resolution.requested_model, int(self.clock()))

    async def stream(self, req: ResolvedRequest) -> AsyncIterator[dict[str, Any]]:
        ex = await self.execution(req)
        if ex is None or not ex.uses_pipeline:
            return await self.direct.stream(self._direct_request(req, ex))
        await self._start(req)
        body = {**req.body, "model": req.resolution.requested_model}
        return self._pipeline(req).stream(self._context(req), body, ex).__aiter__()
