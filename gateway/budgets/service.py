"""``Budgets``: reserve / settle / release / status over a counter backend.

The one object the request path talks to. It resolves which policies apply to a caller
(tenant's and key's), derives their current UTC windows from the injected clock, and
asks the backend to hold the worst-case cost on all of them atomically. Threshold
crossings are handed to the alert notifier, which never blocks. Must not import routes,
the app, the pipeline or providers.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Protocol

from gateway.budgets.counters import CounterBackend, CounterState
from gateway.budgets.periods import PeriodName, utc_now, window_for
from gateway.budgets.policies import BudgetPolicy, PolicyStore, PrincipalLike
from gateway.budgets.reservations import CounterRef, Reservation, from_nanos, to_nanos
from gateway.budgets.spend import SpendSource
from gateway.errors import BudgetExceeded

REMAINING_HEADER = "x-tiergate-budget-remaining-usd"
# The counter of a soft-only budget (a soft limit without a hard one) holds against this: it is
# counted and alerted on like any budget, and never refuses (about 4.6 billion USD).
NO_HARD_LIMIT_NANOS = 1 << 62


def _hard(ref: CounterRef) -> bool:
    return ref.limit_nanos < NO_HARD_LIMIT_NANOS


@dataclass(frozen=True)
class BudgetStatus:
    """The tightest budget applying to a caller right now (None fields: no limit set)."""

    remaining_usd: float | None
    soft_exceeded: bool
    hard_limit_usd: float | None
    soft_limit_usd: float | None = None
    spent_usd: float = 0.0
    held_usd: float = 0.0
    subject: str | None = None
    period: PeriodName | None = None
    period_key: str | None = None
    resets_in_s: float | None = None

    def headers(self) -> dict[str, str]:
        return {} if self.remaining_usd is None else {REMAINING_HEADER: f"{max(self.remaining_usd, 0.0):.9f}"}


UNLIMITED = BudgetStatus(remaining_usd=None, soft_exceeded=False, hard_limit_usd=None)


class AlertSink(Protocol):
    def observe(self, policy: BudgetPolicy, period_key: str, spent_nanos: int) -> None: ...


class Budgets:
    def __init__(self, policies: PolicyStore, counters: CounterBackend, spend: SpendSource, *,
                 lease_s: float = 300.0, clock: Callable[[], datetime] = utc_now,
                 alerts: AlertSink | None = None) -> None:
        self.policies = policies
        self.counters = counters
        self._spend = spend
        self._lease = timedelta(seconds=lease_s)
        self._clock = clock
        self._alerts = alerts
        self._policy_by_subject: dict[str, BudgetPolicy] = {}

    async def start(self) -> None:
        await self.counters.start()

    async def stop(self) -> None:
        await self.counters.stop()

    async def _load(self, ref: CounterRef) -> int:
        subject_id = ref.key_id if ref.scope == "key" else ref.tenant_id
        assert subject_id is not None
        return await self._spend.spent(ref.scope, subject_id, ref.window)

    def _refs(self, policies: Sequence[BudgetPolicy], now: datetime) -> list[tuple[BudgetPolicy, CounterRef]]:
        out = []
        for p in policies:
            if p.limit_nanos is None and p.soft_limit_nanos is None:
                continue
            self._policy_by_subject[p.subject] = p
            limit = NO_HARD_LIMIT_NANOS if p.limit_nanos is None else p.limit_nanos
            out.append((p, CounterRef(p.subject, p.scope, p.tenant_id, p.key_id, window_for(p.period, now), limit)))
        return out

    async def reserve(self, principal: PrincipalLike, worst_case_usd: float, *,
                      request_id: str | None = None) -> Reservation:
        """Hold ``worst_case_usd`` on every budget of the caller, or raise ``BudgetExceeded``."""
        now = self._clock()
        pairs = self._refs(await self.policies.for_principal(principal), now)
        res = Reservation(id=uuid.uuid4().hex, tenant_id=principal.tenant_id, key_id=principal.key_id,
                          request_id=request_id, counters=tuple(r for _, r in pairs),
                          amount_nanos=max(to_nanos(worst_case_usd), 0), created_at=now,
                          expires_at=now + self._lease)
        if not pairs:
            return res
        outcome = await self.counters.reserve(res, self._load)
        remaining = min((s.remaining(r.limit_nanos) for (_, r), s in zip(pairs, outcome.states, strict=True)
                         if _hard(r)), default=None)
        if not outcome.ok:
            policy, ref = pairs[outcome.denied_index or 0]
            state = outcome.states[outcome.denied_index or 0]
            left = from_nanos(max(state.remaining(ref.limit_nanos), 0))
            raise BudgetExceeded(
                f"{policy.scope} budget exhausted for this {policy.period} period "
                f"(limit ${from_nanos(ref.limit_nanos):.6f}, remaining ${left:.6f}, "
                f"this request may cost up to ${res.amount_usd:.6f})",
                headers={REMAINING_HEADER: f"{left:.9f}"})
        return replace(res, remaining_nanos=remaining)

    async def settle(self, reservation: Reservation, actual_usd: float) -> BudgetStatus:
        """Replace the hold by the actual cost; returns the caller's status afterwards."""
        if not reservation.counters:
            return UNLIMITED
        states = await self.counters.settle(reservation, max(to_nanos(actual_usd), 0))
        if self._alerts is not None:
            for ref, s in zip(reservation.counters, states, strict=True):
                policy = self._policy_by_subject.get(ref.subject)
                if policy is not None:
                    self._alerts.observe(policy, ref.window.key, s.spent_nanos)
        return self._tightest(list(zip(reservation.counters, states, strict=True)))

    async def release(self, reservation: Reservation) -> None:
        if reservation.counters:
            await self.counters.release(reservation)

    async def status(self, principal: PrincipalLike) -> BudgetStatus:
        pairs = self._refs(await self.policies.for_principal(principal), self._clock())
        if not pairs:
            return UNLIMITED
        refs = [r for _, r in pairs]
        states = await self.counters.snapshot(refs, self._load)
        return self._tightest(list(zip(refs, states, strict=True)))

    def _tightest(self, pairs: Sequence[tuple[CounterRef, CounterState]]) -> BudgetStatus:
        if not pairs:
            return UNLIMITED
        soft = False
        for ref, s in pairs:
            p = self._policy_by_subject.get(ref.subject)
            if p is not None and p.soft_limit_nanos is not None and s.spent_nanos >= p.soft_limit_nanos:
                soft = True
        ref, s = min(pairs, key=lambda rs: rs[1].remaining(rs[0].limit_nanos))
        p = self._policy_by_subject.get(ref.subject)
        hard = _hard(ref)
        return BudgetStatus(
            remaining_usd=from_nanos(s.remaining(ref.limit_nanos)) if hard else None, soft_exceeded=soft,
            hard_limit_usd=from_nanos(ref.limit_nanos) if hard else None,
            soft_limit_usd=None if p is None or p.soft_limit_nanos is None else from_nanos(p.soft_limit_nanos),
            spent_usd=from_nanos(s.spent_nanos), held_usd=from_nanos(s.held_nanos), subject=ref.subject,
            period=ref.window.period, period_key=ref.window.key,
            resets_in_s=ref.window.seconds_left(self._clock()))
