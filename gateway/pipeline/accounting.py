"""Per-stage accounting for one pipeline request: prices every upstream call, sends it to the
ledger sink as it happens, enforces the request's cost cap, and sums usage and cost.

Prices come from ``gateway.ledger.cost_for``. Baseline: each call's tokens priced at the high
tier (what the same work costs when the high tier does all of it); the request's baseline is
the sum over its calls, so ledger rows, headers and the response always add up. Ledger-sink
failures propagate (money path).

Imports settings, the ledger's pricing, the provider contract and pipeline types only.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gateway.ledger.entries import new_entry_id
from gateway.ledger.pricing import cost_for, price_for
from gateway.pipeline.types import (
    CallStatus,
    Clock,
    LedgerSink,
    RequestContext,
    Stage,
    StageCall,
    calls_baseline_cost_usd,
    calls_cost_usd,
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

    def __init__(self, stage: str, spent_usd: float, estimate_usd: float, cap_usd: float) -> None:
        super().__init__(f"{stage} would cost up to ${estimate_usd:.6f}; ${spent_usd:.6f} of "
                         f"${cap_usd:.6f} already spent", stage)
        self.spent_usd, self.estimate_usd, self.cap_usd = spent_usd, estimate_usd, cap_usd


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
        self.max_cost_usd = max_cost_usd
        self.calls: list[StageCall] = []
        self._reserved_usd = 0.0  # worst-case cost of calls in flight

    @property
    def cost_usd(self) -> float:
        return calls_cost_usd(self.calls)

    @property
    def baseline_cost_usd(self) -> float:
        return calls_baseline_cost_usd(self.calls)

    @property
    def usage(self) -> Usage:
        return calls_usage(self.calls)

    def worst_case_usd(self, tier: str, messages: list[dict[str, Any]], max_tokens: int) -> float:
        """The most one call may cost: over-estimated prompt tokens and ``max_tokens`` of output at
        the dearest price of the tier's model chain (a fallback can cost more than the primary)."""
        prompt = estimate_prompt_tokens(messages)
        t = self.settings.tiers[tier]  # type: ignore[index]
        return max(price_for(self.settings, tier, name).cost_usd(prompt, 0, max_tokens)
                   for name in (t.model, *t.fallbacks))

    def reserve(self, stage: str, tier: str, messages: list[dict[str, Any]], max_tokens: int) -> float:
        """Check the cost cap before a call; returns the amount held until ``release``."""
        estimate = self.worst_case_usd(tier, messages, max_tokens)
        cap = self.max_cost_usd
        if cap is not None and self.cost_usd + self._reserved_usd + estimate > cap:
            raise CostCapReached(stage, self.cost_usd + self._reserved_usd, estimate, cap)
        self._reserved_usd += estimate
        return estimate

    def release(self, amount: float) -> None:
        self._reserved_usd = max(0.0, self._reserved_usd - amount)

    def record(self, stage: Stage, tier: str, model: str, usage: Usage, status: CallStatus = "ok", *,
               step_id: str | None = None, path: int | None = None, round: int = 0) -> StageCall:
        cost, baseline = cost_for(self.settings, tier, model, usage)
        call = StageCall(
            id=new_entry_id(), request_id=self.ctx.request_id, tenant_id=self.ctx.tenant_id,
            key_id=self.ctx.key_id, stage=stage, tier=tier, model=model, usage=usage, cost_usd=cost,
            baseline_cost_usd=baseline, status=status,
            created_at=datetime.fromtimestamp(self.clock(), tz=UTC), step_id=step_id, path=path,
            round=round)
        self.calls.append(call)
        self.ledger_sink(call.to_ledger_entry())
        return call

    def stage_totals(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for c in self.calls:
            row = out.setdefault(c.stage, {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                           "cost_usd": 0.0, "tiers": []})
            row["calls"] += 1
            row["prompt_tokens"] += c.usage.prompt_tokens
            row["completion_tokens"] += c.usage.completion_tokens
            row["cost_usd"] += c.cost_usd
            if c.tier not in row["tiers"]:
                row["tiers"].append(c.tier)
        return out
