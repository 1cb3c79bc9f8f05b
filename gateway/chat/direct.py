"""``DirectExecutor``: one routed call per request (the decision's model chain, with retries and
fallbacks), one ledger row per upstream attempt — failed and cancelled ones too — handed to the
request's ``CallSink`` as the attempt ends. Returns a ``Completion`` or a ``DirectStream``.

Imports the provider router, ledger entries and pricing, and the chat types; no FastAPI.
"""

from __future__ import annotations

from typing import Any

from gateway.chat.request import CallContext, ChatRequest
from gateway.chat.spend import NOTHING, Completion, Spend
from gateway.ids import fast_id
from gateway.ledger.entries import LedgerEntry
from gateway.ledger.pricing import build_intent, call_cost_nanos
from gateway.providers.base import ChunkStream, Usage
from gateway.providers.registry import ProviderRegistry
from gateway.providers.router import Attempt, CallStart, call_models, stream_models
from gateway.settings import Settings


def cost_nanos_of(settings: Settings, tier: str | None, model_name: str, usage: Usage) -> tuple[int, int]:
    """(cost, baseline) of one call in nano-USD at ``tier``'s prices; a model called by its own
    name (``tier`` None, see ``RouteDecision.price_tier``) at its own price."""
    return call_cost_nanos(settings, tier, model_name, usage)


class _Attempts:
    """Journals each call's intent before the router makes it (``begin``), prices each attempt
    the router reports, hands its row (the intent's id) to the sink and sums it."""

    def __init__(self, settings: Settings, req: ChatRequest, calls: CallContext) -> None:
        self.settings, self.req, self.calls = settings, req, calls
        self.spend = NOTHING

    async def begin(self, start: CallStart) -> str:
        req, d = self.req, self.req.decision
        call_id = fast_id()
        await self.calls.sink.begin(build_intent(
            self.settings, call_id=call_id, request_id=req.request_id, tenant_id=req.tenant_id, key_id=req.key_id,
            stage="direct", tier=d.tier, price_tier=d.price_tier(self.settings), model_name=start.model_name,
            prompt_tokens=start.prompt_tokens, max_output_tokens=start.max_output_tokens))
        return call_id

    def __call__(self, attempt: Attempt) -> None:
        req, d = self.req, self.req.decision
        cost, baseline = cost_nanos_of(self.settings, d.price_tier(self.settings), attempt.model_name, attempt.usage)
        entry = LedgerEntry(id=attempt.call_id or fast_id(), request_id=req.request_id, tenant_id=req.tenant_id, key_id=req.key_id,
                            stage="direct", tier=d.tier, model=attempt.model_name, usage=attempt.usage,
                            cost_nanos=cost, baseline_cost_nanos=baseline, status=attempt.status)
        self.calls.sink.record(entry)
        self.spend = self.spend + Spend.of(entry)


class DirectExecutor:
    def __init__(self, settings: Settings, registry: ProviderRegistry) -> None:
        self.settings, self.registry = settings, registry

    async def complete(self, req: ChatRequest, calls: CallContext) -> Completion:
        attempts = _Attempts(self.settings, req, calls)
        d = req.decision
        response, _ = await call_models(self.registry, d.models, d.body, req.options, on_attempt=attempts)
        return Completion(response, attempts.spend)

    async def stream(self, req: ChatRequest, calls: CallContext) -> DirectStream:
        attempts = _Attempts(self.settings, req, calls)
        d = req.decision
        chunks, _ = await stream_models(self.registry, d.models, d.body, req.options, on_attempt=attempts)
        return DirectStream(chunks, attempts)


class DirectStream:
    """The upstream's chunks; ``spend`` covers every attempt once the stream ended or was closed."""

    def __init__(self, chunks: ChunkStream, attempts: _Attempts) -> None:
        self._chunks, self._attempts = chunks, attempts

    def __aiter__(self) -> DirectStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()  # no-op once the stream ended; else cancels the upstream, bills it

    @property
    def spend(self) -> Spend:
        return self._attempts.spend
