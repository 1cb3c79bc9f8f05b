"""Executing a resolved chat request: the hook between the route and the models.

``Executor`` is the one seam the route calls. ``DirectExecutor`` (the default) makes one
routed call over the resolution's model chain — retries and fallbacks included — and writes
one ``LedgerEntry`` (stage ``direct``) per upstream attempt, failed and cancelled ones too.
The four-layer pipeline plugs in by passing another ``Executor`` to ``create_app`` (or by
wrapping this one and delegating low tiers to it).

Imports providers, ledger entries and pricing, settings and errors (and the budgets' ``Hold``
type, for type checking only); knows nothing of FastAPI.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gateway.ids import fast_id
from gateway.ledger.entries import LedgerEntry
from gateway.ledger.pricing import baseline_nanos, cost_nanos_for, model_price
from gateway.providers.base import CallOptions, Usage
from gateway.providers.registry import ProviderRegistry
from gateway.providers.router import Attempt, call_models, stream_models
from gateway.resolve import Resolution
from gateway.settings import Settings

if TYPE_CHECKING:
    from gateway.budgets import Hold


class LedgerSink(Protocol):
    def record(self, entry: LedgerEntry) -> None: ...


class CallBudget(Protocol):
    """Per-call budget holds for one request (set by ``BudgetedExecutor``). An executor that makes
    several upstream calls (the pipeline) calls ``meter_per_call`` once, then holds each call's
    worst case (nano-USD) before making it and settles the ``Hold`` to what the call cost (its
    ledger rows); ``hold`` raises ``BudgetExceeded`` when the budget cannot."""

    async def meter_per_call(self) -> None: ...

    async def hold(self, worst_case_nanos: int) -> Hold: ...


@dataclass
class CallTally:
    """What one request has spent so far (summed over its upstream attempts)."""

    usage: Usage = field(default_factory=Usage)
    cost_nanos: int = 0  # nano-USD, the sum of the request's ledger rows
    baseline_cost_nanos: int = 0
    calls: int = 0
    model: str | None = None
    pipeline: bool = False  # set by the pipeline executor (gateway.pipeline.executor)
    effort: str | None = None  # the effort tier actually executed, when the routing policy ran
    effort_source: str | None = None  # budget_cap when the soft budget capped the effort
    response_headers: dict[str, str] = field(default_factory=dict)  # e.g. the remaining budget
    # When a list (set by ChatFlow), the direct executor parks its ledger rows here and ChatFlow
    # records them together with the request record, so one journal fsync covers the request
    # (instead of one for the call row and another for the request row). None: record at once.
    deferred: list[LedgerEntry] | None = None

    def take_deferred(self) -> list[LedgerEntry]:
        """The parked rows, and stop parking (later rows are recorded at once)."""
        rows, self.deferred = self.deferred or [], None
        return rows


@dataclass(frozen=True)
class ResolvedRequest:
    """A validated, authenticated, resolved request, ready to execute."""

    request_id: str
    tenant_id: str
    key_id: str | None
    resolution: Resolution
    body: dict[str, Any]  # what goes upstream (client fields minus gateway-only ones)
    options: CallOptions
    tally: CallTally = field(default_factory=CallTally)
    allow_prompt_storage: bool = False  # the tenant lets review feedback keep the prompt's text
    call_budget: CallBudget | None = None  # per-call budget holds (None: no budgets in front)
    started: float = field(default_factory=time.perf_counter)


class Executor(Protocol):
    async def complete(self, req: ResolvedRequest) -> dict[str, Any]:
        """A chat.completion dict; every upstream call already handed to the ledger."""
        ...

    async def stream(self, req: ResolvedRequest) -> AsyncIterator[dict[str, Any]]:
        """An opened chunk stream: errors before the first chunk raise here. Closing it cancels
        the upstream call and bills what was generated."""
        ...


def cost_nanos_of(settings: Settings, tier: str | None, model_name: str, usage: Usage) -> tuple[int, int]:
    """(cost, baseline) of one call in nano-USD (``gateway.ledger.cost_nanos_for``) at ``tier``'s
    prices; a model called by its own name (``tier`` None, see ``Resolution.price_tier``) at its
    own price."""
    if tier is not None and tier in settings.tiers:
        return cost_nanos_for(settings, tier, model_name, usage)
    return model_price(settings.models[model_name]).cost_nanos(usage), baseline_nanos(settings, usage)


class DirectExecutor:
    """One routed call per request; one ledger row per upstream attempt."""

    def __init__(self, settings: Settings, registry: ProviderRegistry, ledger: LedgerSink) -> None:
        self.settings, self.registry, self.ledger = settings, registry, ledger

    def _on_attempt(self, req: ResolvedRequest) -> Callable[[Attempt], None]:
        def record(attempt: Attempt) -> None:
            tier = req.resolution.tier
            cost, baseline = cost_nanos_of(self.settings, req.resolution.price_tier(self.settings),
                                           attempt.model_name, attempt.usage)
            entry = LedgerEntry(
                id=fast_id(), request_id=req.request_id, tenant_id=req.tenant_id, key_id=req.key_id,
                stage="direct", tier=tier, model=attempt.model_name, usage=attempt.usage, cost_nanos=cost,
                baseline_cost_nanos=baseline, status=attempt.status)
            t = req.tally
            if t.deferred is not None:
                t.deferred.append(entry)
            else:
                self.ledger.record(entry)
            t.usage, t.cost_nanos, t.baseline_cost_nanos = t.usage + attempt.usage, t.cost_nanos + cost, \
                t.baseline_cost_nanos + baseline
            t.calls += 1
            t.model = attempt.model_name
        return record

    async def complete(self, req: ResolvedRequest) -> dict[str, Any]:
        response, _ = await call_models(self.registry, req.resolution.models, req.body, req.options,
                                        on_attempt=self._on_attempt(req))
        return response

    async def stream(self, req: ResolvedRequest) -> AsyncIterator[dict[str, Any]]:
        chunks, _ = await stream_models(self.registry, req.resolution.models, req.body, req.options,
                                        on_attempt=self._on_attempt(req))
        return chunks
