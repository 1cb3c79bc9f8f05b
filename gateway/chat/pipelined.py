"""``PipelinedExecutor``: the four-layer pipeline (gateway.pipeline) as a chat executor, for the
requests whose ``RouteDecision`` runs it (effort high/xhigh routed by ``auto``, or a request that
forced ``tiergate.pipeline: on``). Every stage call's ledger row goes to the request's
``CallSink`` as the call ends; with budgets in front, every call holds its own worst case first
(``CallContext.budget``). The tenant's ``allow_prompt_storage`` reaches the review feedback.

Imports the pipeline, the provider router, ledger entries and the chat types; never FastAPI.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from gateway.chat.request import CallContext, ChatRequest
from gateway.chat.spend import NOTHING, CallSink, Completion, Spend
from gateway.ledger.entries import CallIntent, LedgerEntry
from gateway.pipeline.runner import Pipeline
from gateway.pipeline.stream import PipelineStream
from gateway.pipeline.types import Clock, FeedbackSink, RequestContext
from gateway.providers.registry import ProviderRegistry
from gateway.providers.router import call_tier, stream_tier
from gateway.settings import Settings


class _Counted:
    """Hands rows on to the request's sink and sums them: this executor's ``Spend``."""

    def __init__(self, sink: CallSink) -> None:
        self.sink, self.spend = sink, NOTHING

    def __call__(self, entry: LedgerEntry) -> None:
        self.sink.record(entry)
        self.spend = self.spend + Spend.of(entry)

    async def begin(self, intent: CallIntent) -> None:
        await self.sink.begin(intent)


class PipelinedExecutor:
    def __init__(self, settings: Settings, registry: ProviderRegistry, *,
                 feedback_sink: FeedbackSink | None = None, clock: Clock = time.time) -> None:
        self.settings, self.registry, self.feedback_sink, self.clock = settings, registry, feedback_sink, clock

    async def _pipeline(self, calls: CallContext, counted: _Counted) -> Pipeline:
        if calls.budget is not None:
            await calls.budget.meter_per_call()  # many calls: each holds its own worst case
        return Pipeline(self.settings, functools.partial(call_tier, self.registry, self.settings), counted,
                        self.feedback_sink, self.clock, functools.partial(stream_tier, self.registry, self.settings),
                        calls.budget)

    @staticmethod
    def _context(req: ChatRequest) -> RequestContext:
        return RequestContext(request_id=req.request_id, tenant_id=req.tenant_id, key_id=req.key_id,
                              allow_prompt_storage=req.allow_prompt_storage)

    async def complete(self, req: ChatRequest, calls: CallContext) -> Completion:
        d = req.decision
        assert d.plan is not None and d.plan.uses_pipeline
        counted = _Counted(calls.sink)
        result = await (await self._pipeline(calls, counted)).run(self._context(req), d.body, d.plan)
        return Completion(result.to_response(req.request_id, d.requested_model, int(self.clock())), counted.spend)

    async def stream(self, req: ChatRequest, calls: CallContext) -> PipelinedStream:
        d = req.decision
        assert d.plan is not None and d.plan.uses_pipeline
        counted = _Counted(calls.sink)
        pipeline = await self._pipeline(calls, counted)
        chunks = pipeline.stream(self._context(req), {**d.body, "model": d.requested_model}, d.plan)
        return PipelinedStream(chunks, counted)


class PipelinedStream:
    """Stage progress, then the answer, as chunks; ``spend`` covers every stage call so far."""

    def __init__(self, chunks: PipelineStream, counted: _Counted) -> None:
        self._chunks, self._counted = chunks.__aiter__(), counted

    def __aiter__(self) -> PipelinedStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()  # cancels the running stage; its call is billed

    @property
    def spend(self) -> Spend:
        return self._counted.spend
