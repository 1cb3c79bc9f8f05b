"""Per-stage accounting for one pipeline request: prices every upstream call, sends it to the
ledger sink as it happens, enforces the request's cost cap, and sums usage and cost.

Prices come from ``gateway.ledger.cost_nanos_for``; every amount is integer nano-USD (the cost
cap, ``tiergate.max_cost_usd``, is converted once). Baseline: each call's tokens priced at the
high tier (what the same work costs when the high tier does all of it); the request's baseline
is the sum over its calls, so ledger rows, headers and the response always add up exactly.
Ledger-sink failures propagate (money path).

Imports settings, gateway.money, the ledger's pricing, the provider contract and pipeline types only.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gateway.ledger.entries import new_entry_id
from gateway.ledger.pricing import build_intent, cost_nanos_for, price_for
from gateway.money import format_usd, usd_to_nanos
from gateway.pipeline.types import (
    CallStatus,
    Clock,
    LedgerSink,
    RequestContext,
    Stage,
    StageCall,
    calls_baseline_cost_nanos,
    calls_cost_nanos,
    calls_usage,
)
from gateway.providers.base import Usage
from gateway.settings import Settings

CHARS_PER_TOKEN_LOWER_BOUND = 2.0  # for worst-case cost estimates: over-estimates prompt tokens


class StopEarly(Exception):
    """The pipeline must stop before its next call and answer with what it has so far."""

    reason = "stopped"

    def __init__(self, message: str, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


class CostCapReached(StopEarly):
    """The next call could push the request past ``tiergate.max_cost_usd``."""

    reason = "cost_cap"

    def __init__(self, stage: str, spent_nanos: int, estimate_nanos: int, cap_nanos: int) -> None:
        super().__init__(f"{stage} would cost up to ${format_usd(estimate_nanos, 6)}; "
                         f"${format_usd(spent_nanos, 6)} of ${format_usd(cap_nanos, 6)} already spent", stage)
        self.spent_nanos, self.estimate_nanos, self.cap_nanos = spent_nanos, estimate_nanos, cap_nanos


class BudgetRefused(StopEarly):
    """The tenant's (or key's) hard budget cannot hold the next call's worst case. ``error`` is
    the budgets' ``BudgetExceeded`` (429), raised as is when nothing has been produced yet."""

    reason = "budget"

    def __init__(self, stage: str, error: Exception) -> None:
        super().__init__(f"{stage}: {error}", stage)
        self.error = error


def estimate_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    chars = sum(len(str(m.get("content") or "")) + 8 for m in messages)
    return int(chars / CHARS_PER_TOKEN_LOWER_BOUND) + 1


class Accountant:
    """Collects the request's ``StageCall`` rows; one instance per request."""

    def __init__(self, settings: Settings, ctx: RequestContext, ledger_sink: LedgerSink, clock: Clock,
                 max_cost_usd: float | None = None) -> None:
        self.settings, self.ctx, self.ledger_sink, self.clock = settings, ctx, ledger_sink, clock
        self.max_cost_nanos = None if max_cost_usd is None else usd_to_nanos(max_cost_usd)
        self.calls: list[StageCall] = []
        self._reserved_nanos = 0  # worst-case cost of calls in flight

    @property
    def cost_nanos(self) -> int:
        return calls_cost_nanos(self.calls)

    @property
    def baseline_cost_nanos(self) -> int:
        return calls_baseline_cost_nanos(self.calls)

    @property
    def usage(self) -> Usage:
        return calls_usage(self.calls)

    def worst_case_nanos(self, tier: str, messages: list[dict[str, Any]], max_tokens: int) -> int:
        """The most one call may cost: over-estimated prompt tokens and ``max_tokens`` of output at
        the dearest price of the tier's model chain (a fallback can cost more than the primary)."""
        prompt = estimate_prompt_tokens(messages)
        t = self.settings.tiers[tier]  # type: ignore[index]
        return max(price_for(self.settings, tier, name).nanos(prompt, 0, max_tokens)
                   for name in (t.model, *t.fallbacks))

    def reserve(self, stage: str, tier: str, messages: list[dict[str, Any]], max_tokens: int) -> int:
        """Check the cost cap before a call; returns the nano-USD held until ``release``."""
        estimate = self.worst_case_nanos(tier, messages, max_tokens)
        cap = self.max_cost_nanos
        if cap is not None and self.cost_nanos + self._reserved_nanos + estimate > cap:
            raise CostCapReached(stage, self.cost_nanos + self._reserved_nanos, estimate, cap)
        self._reserved_nanos += estimate
        return estimate

    def release(self, amount_nanos: int) -> None:
        self._reserved_nanos = max(0, self._reserved_nanos - amount_nanos)

    async def begin(self, stage: Stage, tier: str, model: str, prompt_tokens: int, max_output_tokens: int) -> str:
        """Journal the intent of a call about to be made (when the ledger sink takes intents, see
        ``IntentSink``); returns the call id its row will carry."""
        call_id = new_entry_id()
        begin = getattr(self.ledger_sink, "begin", None)
        if begin is not None:
            await begin(build_intent(self.settings, call_id=call_id, request_id=self.ctx.request_id,
                                     tenant_id=self.ctx.tenant_id, key_id=self.ctx.key_id, stage=stage, tier=tier,
                                     price_tier=tier, model_name=model, prompt_tokens=prompt_tokens,
                                     max_output_tokens=max_output_tokens))
        return call_id

    def record(self, stage: Stage, tier: str, model: str, usage: Usage, status: CallStatus = "ok", *,
               step_id: str | None = None, path: int | None = None, round: int = 0,
               call_id: str | None = None) -> StageCall:
        cost, baseline = cost_nanos_for(self.settings, tier, model, usage)
        call = StageCall(
            id=call_id or new_entry_id(), request_id=self.ctx.request_id, tenant_id=self.ctx.tenant_id,
            key_id=self.ctx.key_id, stage=stage, tier=tier, model=model, usage=usage, cost_nanos=cost,
            baseline_cost_nanos=baseline, status=status,
            created_at=datetime.fromtimestamp(self.clock(), tz=UTC), step_id=step_id, path=path,
            round=round)
        self.calls.append(call)
        self.ledger_sink(call.to_ledger_entry())
        return call

    def stage_totals(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for c in self.calls:
            row = out.setdefault(c.stage, {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                           "cost_nanos": 0, "tiers": []})
            row["calls"] += 1
            row["prompt_tokens"] += c.usage.prompt_tokens
            row["completion_tokens"] += c.usage.completion_tokens
            row["cost_nanos"] += c.cost_nanos
            if c.tier not in row["tiers"]:
                row["tiers"].append(c.tier)
        return out
