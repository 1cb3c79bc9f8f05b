"""Calling a model for one pipeline stage: builds the upstream body, applies the tier's engine
knobs (experts per token), and accounts every upstream attempt the router reports (retries,
fallbacks and cancelled streams included) as a ledger row. Before each call a ``Ticket`` is
taken: the request's cost cap is checked and, when budgets are in front (``CallBudget``), the
call's worst case is held on the tenant's and key's budgets (``BudgetRefused`` when they cannot
hold it). The ticket is settled to the call's ledger rows when the call ends, fails, is
cancelled, or (streams) is closed.

Imports pipeline types/accounting, the execution hook's budget protocol, the budgets' ``Hold``
type, the provider contract and router types only (the model is reached through the injected
``CallModel`` / ``StreamModel`` callables).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.budgets import Hold
from gateway.errors import BudgetExceeded, UpstreamError
from gateway.pipeline.accounting import Accountant, BudgetRefused
from gateway.pipeline.types import CallBudget, CallModel, Stage, StageCall, StreamModel
from gateway.providers.base import CallOptions, Usage
from gateway.providers.router import Attempt, CallStart
from gateway.settings import Settings
from gateway.telemetry import tracing


@dataclass(frozen=True)
class Reply:
    text: str
    call: StageCall  # the accounted attempt that produced this reply

    @property
    def model(self) -> str:
        return self.call.model

    @property
    def usage(self) -> Usage:
        return self.call.usage


def message_text(response: dict[str, Any]) -> str:
    choices = response.get("choices") or []
    if not choices:
        raise UpstreamError("upstream returned no choices", retryable=False)
    return str((choices[0].get("message") or {}).get("content") or "")


class Ticket:
    """What one call holds before it runs: its share of the cost cap and its budget hold."""

    def __init__(self, accountant: Accountant, capped_nanos: int, hold: Hold | None) -> None:
        self.accountant, self.capped_nanos, self.hold = accountant, capped_nanos, hold
        self.opened = False  # a stream was opened on it (the stream closes it)
        self.closed = False

    async def close(self, calls: Sequence[StageCall]) -> None:
        """Give the cost-cap share back and settle the budget hold to ``calls``' ledger rows."""
        if self.closed:
            return
        self.closed = True
        self.accountant.release(self.capped_nanos)
        if self.hold is not None:
            await asyncio.shield(self.hold.settle(sum(c.cost_nanos for c in calls)))


class HeldStream:
    """An opened stream whose ticket is settled once the stream ends, fails or is closed."""

    def __init__(self, chunks: AsyncIterator[dict[str, Any]], ticket: Ticket, calls: list[StageCall]) -> None:
        self.chunks, self.ticket, self.calls = chunks, ticket, calls

    def __aiter__(self) -> HeldStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        try:
            return await self.chunks.__anext__()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        try:
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()  # bills what was generated (the attempt lands in self.calls)
        finally:
            await self.ticket.close(self.calls)


class _StageBilling:
    """The router's ``Billing`` for one stage call: journals each attempt's intent before it is
    made, and accounts each attempt it reports as a ledger row with the intent's id."""

    def __init__(self, accountant: Accountant, stage: Stage, tier: str, step_id: str | None, path: int | None,
                 round: int) -> None:
        self.accountant, self.stage, self.tier = accountant, stage, tier
        self.step_id, self.path, self.round = step_id, path, round
        self.calls: list[StageCall] = []

    async def begin(self, start: CallStart) -> str:
        return await self.accountant.begin(self.stage, self.tier, start.model_name, start.prompt_tokens,
                                           start.max_output_tokens)

    def __call__(self, attempt: Attempt) -> None:
        self.calls.append(self.accountant.record(self.stage, self.tier, attempt.model_name, attempt.usage,
                                                 attempt.status, step_id=self.step_id, path=self.path,
                                                 round=self.round, call_id=attempt.call_id))


class StageCaller:
    """The only way pipeline stages reach a model."""

    def __init__(self, settings: Settings, call_model: CallModel, accountant: Accountant,
                 stream_model: StreamModel | None = None, sampling: dict[str, Any] | None = None,
                 budget: CallBudget | None = None, on_admitted: Callable[[], None] | None = None) -> None:
        self.settings, self.call_model, self.accountant = settings, call_model, accountant
        self.stream_model, self.budget = stream_model, budget
        self.on_admitted = on_admitted  # called once the first call holds its budget (streams wait for it)
        self.sampling = dict(sampling or {})  # the client's temperature/top_p/seed, for every stage

    async def ticket(self, stage: Stage, tier: str, messages: list[dict[str, Any]], max_tokens: int) -> Ticket:
        """Check the cost cap (``CostCapReached``), then hold the call's worst case on the budgets
        (``BudgetRefused``). Close the ticket, or hand it to ``call``/``stream``."""
        worst = self.accountant.reserve(stage, tier, messages, max_tokens)
        hold: Hold | None = None
        if self.budget is not None:
            try:
                hold = await self.budget.hold(worst)
            except BudgetExceeded as err:
                self.accountant.release(worst)
                raise BudgetRefused(stage, err) from err
            except BaseException:
                self.accountant.release(worst)
                raise
        if self.on_admitted is not None:
            admitted, self.on_admitted = self.on_admitted, None
            admitted()
        return Ticket(self.accountant, worst, hold)

    def options(self, tier: str) -> CallOptions:
        knobs = self.settings.tiers[tier].engine  # type: ignore[index]
        return CallOptions(experts_per_token=knobs.experts_per_token, speculative=knobs.speculative,
                           cache_salt=self.accountant.ctx.tenant_id)

    def _billing(self, stage: Stage, tier: str, *, step_id: str | None, path: int | None,
                 round: int) -> tuple[_StageBilling, list[StageCall]]:
        billing = _StageBilling(self.accountant, stage, tier, step_id, path, round)
        return billing, billing.calls

    def body(self, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
        return {"messages": messages, "max_tokens": max_tokens, **self.sampling, **extra}

    async def call(self, stage: Stage, tier: str, messages: list[dict[str, Any]], max_tokens: int, *,
                   step_id: str | None = None, path: int | None = None, round: int = 0,
                   **extra: Any) -> Reply:
        ticket = await self.ticket(stage, tier, messages, max_tokens)
        on_attempt, calls = self._billing(stage, tier, step_id=step_id, path=path, round=round)
        try:
            with tracing.stage(stage, tier, **{"tiergate.step": step_id, "tiergate.path": path,
                                               "tiergate.round": round}):
                response, model = await self.call_model(tier, self.body(messages, max_tokens, **extra),
                                                        self.options(tier), on_attempt=on_attempt)
            ok = [c for c in calls if c.status == "ok"]
            if not ok:  # a caller that did not report its attempt: bill what the response says
                ok = [self.accountant.record(stage, tier, model, Usage.from_openai(response.get("usage")),
                                             "ok", step_id=step_id, path=path, round=round)]
                calls.extend(ok)
        finally:
            await ticket.close(calls)
        return Reply(message_text(response), ok[-1])

    async def stream(self, stage: Stage, tier: str, messages: list[dict[str, Any]], max_tokens: int, *,
                     step_id: str | None = None, path: int | None = None, round: int = 0,
                     ticket: Ticket | None = None, **extra: Any) -> AsyncIterator[dict[str, Any]]:
        """An opened chunk stream; the attempt is billed (and the ticket settled) when it ends or
        is closed (cancelled). ``ticket``: one taken beforehand with ``ticket()``."""
        if self.stream_model is None:
            raise RuntimeError("no stream_model was given to the pipeline")
        ticket = ticket or await self.ticket(stage, tier, messages, max_tokens)
        ticket.opened = True
        on_attempt, calls = self._billing(stage, tier, step_id=step_id, path=path, round=round)
        body = self.body(messages, max_tokens, **extra)
        span = tracing.open_stage(stage, tier, **{"tiergate.step": step_id, "tiergate.path": path,
                                                  "tiergate.round": round})  # ends with the stream's attempt
        try:
            with tracing.use(span):
                chunks, _model = await self.stream_model(tier, body, self.options(tier),
                                                         on_attempt=tracing.end_on_attempt(span, on_attempt))
        except BaseException as err:
            tracing.end(span, err)
            await ticket.close(calls)
            raise
        return HeldStream(chunks, ticket, calls)
