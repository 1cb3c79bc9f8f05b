"""Plain data at the pipeline's boundaries: the injected callables, the request context,
one accounted upstream call (``StageCall``) and the review verdict sent to the classifier.

Imports the provider contract and router types, and the ledger's entry type; never FastAPI,
Starlette, Celery, the database or a concrete provider.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol

from gateway.budgets import Hold
from gateway.ledger.entries import CallIntent, LedgerEntry
from gateway.money import usd_number
from gateway.providers.base import CallOptions, Usage
from gateway.providers.router import OnAttempt

Stage = Literal["perceive", "plan", "execute", "review", "direct"]
CallStatus = Literal["ok", "error", "cancelled"]

Clock = Callable[[], float]


class CallBudget(Protocol):
    """Per-call budget holds for one request (``gateway.chat.admission`` provides them). A
    pipeline calls ``meter_per_call`` once, then holds each call's worst case (nano-USD) before
    making it and settles the ``Hold`` to what the call cost (its ledger rows); ``hold`` raises
    ``BudgetExceeded`` when the budgets cannot hold it."""

    async def meter_per_call(self) -> None: ...

    async def hold(self, worst_case_nanos: int) -> Hold: ...


class CallModel(Protocol):
    """``functools.partial(gateway.providers.router.call_tier, registry, settings)``: calls a tier
    (retries, fallbacks) and reports every upstream attempt, with its usage, to ``on_attempt``."""

    async def __call__(self, tier: str, body: dict[str, Any], options: CallOptions, *,
                       on_attempt: OnAttempt) -> tuple[dict[str, Any], str]: ...


class StreamModel(Protocol):
    """``functools.partial(gateway.providers.router.stream_tier, registry, settings)``: opens a
    chunk stream; closing it cancels the upstream, and the attempt is reported (billed) once."""

    async def __call__(self, tier: str, body: dict[str, Any], options: CallOptions, *,
                       on_attempt: OnAttempt) -> tuple[AsyncIterator[dict[str, Any]], str]: ...


@dataclass(frozen=True)
class RequestContext:
    """Who is asking: used to attribute every ledger row and feedback record."""

    request_id: str
    tenant_id: str
    key_id: str | None
    allow_prompt_storage: bool = False


@dataclass(frozen=True)
class StageCall:
    """One upstream call made by the pipeline, priced. Becomes one ledger row."""

    id: str
    request_id: str
    tenant_id: str
    key_id: str | None
    stage: Stage
    tier: str
    model: str
    usage: Usage
    cost_nanos: int  # nano-USD
    baseline_cost_nanos: int
    status: CallStatus
    created_at: datetime
    step_id: str | None = None
    path: int | None = None
    round: int = 0

    def to_ledger_entry(self) -> LedgerEntry:
        return LedgerEntry(id=self.id, request_id=self.request_id, tenant_id=self.tenant_id,
                           key_id=self.key_id, stage=self.stage, tier=self.tier, model=self.model,
                           usage=self.usage, cost_nanos=self.cost_nanos,
                           baseline_cost_nanos=self.baseline_cost_nanos, status=self.status,
                           created_at=self.created_at)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "tier": self.tier, "model": self.model, "status": self.status,
            "step_id": self.step_id, "path": self.path, "round": self.round,
            "prompt_tokens": self.usage.prompt_tokens, "cached_tokens": self.usage.cached_tokens,
            "completion_tokens": self.usage.completion_tokens,
            "reasoning_tokens": self.usage.reasoning_tokens,
            "cost_usd": usd_number(self.cost_nanos), "baseline_cost_usd": usd_number(self.baseline_cost_nanos),
        }


def calls_cost_nanos(calls: Iterable[StageCall]) -> int:
    return sum(c.cost_nanos for c in calls)


def calls_baseline_cost_nanos(calls: Iterable[StageCall]) -> int:
    return sum(c.baseline_cost_nanos for c in calls)


def calls_usage(calls: Iterable[StageCall]) -> Usage:
    """All the calls' tokens added up."""
    total = Usage()
    for c in calls:
        total = total + c.usage
    return total


@dataclass(frozen=True)
class ReviewVerdict:
    """What the review stage concluded, sent to the classifier's learning loop.

    ``label_tier`` is the lowest execution tier whose step outputs the reviewer accepted
    (low when accepted at once, one tier up per revise round, the effort tier when never
    accepted): evidence of how much effort the request really needed."""

    request_id: str
    tenant_id: str
    verdict: Literal["accept", "revise"]
    failing_steps: tuple[str, ...]
    rounds: int
    effort: str
    label_tier: str
    messages: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # in-process only
    allow_prompt_storage: bool = False  # the sink stores text only when True, else features


LedgerSink = Callable[[LedgerEntry], None]  # e.g. Ledger.record: non-blocking, never swallowed


class IntentSink(Protocol):
    """A ``LedgerSink`` that also journals each call's intent before the call (the chat path's
    sinks); ``Accountant.begin`` uses ``begin`` when the sink has it."""

    def __call__(self, entry: LedgerEntry) -> None: ...

    async def begin(self, intent: CallIntent) -> None: ...
FeedbackSink = Callable[[ReviewVerdict], None]
ProgressSink = Callable[[str], None]
