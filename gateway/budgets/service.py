"""``Budgets``: reserve → ``Hold`` (settle / release) and status, over a counter backend.

The one object the request path talks to. It resolves which policies apply to a caller
(tenant's and key's), derives their current UTC windows from the injected clock, and asks the
backend to hold the worst-case cost on all of them atomically; the ``Hold`` it returns ends by
calling back ``settle_hold`` / ``release_hold``. Threshold crossings are handed to the alert
notifier, which never blocks. Money is integer nano-USD throughout. Must not import routes,
the app, the pipeline or providers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Protocol

from gateway.budgets.holds import (
    REMAINING_HEADER,
    UNLIMITED,
    BudgetStatus,
    CounterBackend,
    CounterRef,
    CounterState,
    Hold,
)
from gateway.budgets.outage import CountersUnavailable
from gateway.budgets.periods import utc_now, window_for
from gateway.budgets.policies import BudgetPolicy, PolicyStore, PrincipalLike
from gateway.budgets.spend import SpendSource
from gateway.errors import BudgetExceeded
from gateway.ids import fast_id
from gateway.money import format_usd
from gateway.telemetry import metrics

# The counter of a soft-only budget (a soft limit without a hard one) holds against this: it is
# counted and alerted on like any budget, and never refuses (about 4.6 billion USD).
NO_HARD_LIMIT_NANOS = 1 << 62


def _hard(ref: CounterRef) -> bool:
    return ref.limit_nanos < NO_HARD_LIMIT_NANOS


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

    async def reserve(self, principal: PrincipalLike, worst_case_nanos: int, *,
                      request_id: str | None = None) -> Hold:
        """Hold ``worst_case_nanos`` on every budget of the caller, or raise ``BudgetExceeded``."""
        now = self._clock()
        pairs = self._refs(await self.policies.for_principal(principal), now)
        hold = Hold(id=fast_id(), tenant_id=principal.tenant_id, key_id=principal.key_id,
                    request_id=request_id, counters=tuple(r for _, r in pairs),
                    amount_nanos=max(worst_case_nanos, 0), created_at=now, expires_at=now + self._lease,
                    owner=self)
        if not pairs:
            return hold
        outcome = await self.counters.reserve(hold, self._load)
        if not outcome.ok:
            policy, ref = pairs[outcome.denied_index or 0]
            state = outcome.states[outcome.denied_index or 0]
            left = max(state.remaining(ref.limit_nanos), 0)
            raise BudgetExceeded(
                f"{policy.scope} budget exhausted for this {policy.period} period "
                f"(limit ${format_usd(ref.limit_nanos, 6)}, remaining ${format_usd(left, 6)}, "
                f"this request may cost up to ${format_usd(hold.amount_nanos, 6)})",
                headers={REMAINING_HEADER: format_usd(left)})
        hold.remaining_nanos = min((s.remaining(r.limit_nanos) for (_, r), s in zip(pairs, outcome.states, strict=True)
                                    if _hard(r)), default=None)
        return hold

    async def settle_hold(self, hold: Hold, cost_nanos: int) -> BudgetStatus:
        """Replace ``hold`` by ``cost_nanos`` of spend (call ``hold.settle``, which calls this once)."""
        if not hold.counters:
            return UNLIMITED
        try:
            states = await self.counters.settle(hold, max(cost_nanos, 0))
        except CountersUnavailable:
            # Redis went away after the work was done: the ledger row is the spend (the counter is
            # rebuilt from the database when Redis is back); no remaining-budget header this time.
            return UNLIMITED
        if self._alerts is not None:
            for ref, s in zip(hold.counters, states, strict=True):
                policy = self._policy_by_subject.get(ref.subject)
                if policy is not None:
                    self._alerts.observe(policy, ref.window.key, s.spent_nanos)
        if metrics.budget_series():  # per-subject utilisation (observability.metrics.tenant_label)
            for ref, s in zip(hold.counters, states, strict=True):
                policy = self._policy_by_subject.get(ref.subject)
                if policy is not None:
                    metrics.observe_budget(policy.scope, policy.subject, s.spent_nanos, policy.limit_nanos,
                                           policy.soft_limit_nanos)
        return self._tightest(list(zip(hold.counters, states, strict=True)))

    async def release_hold(self, hold: Hold) -> None:
        """Give ``hold`` back (call ``hold.release``, which calls this once)."""
        if hold.counters:
            await self.counters.release(hold)

    async def charge(self, like: Hold, cost_nanos: int) -> BudgetStatus:
        """Add ``cost_nanos`` of spend that no hold covered, on ``like``'s counters (its id marks
        the settlement; nothing is held, so nothing is released)."""
        extra = Hold(id=like.id + "-uncovered", tenant_id=like.tenant_id, key_id=like.key_id,
                     request_id=like.request_id, counters=like.counters, amount_nanos=0,
                     created_at=like.created_at, expires_at=like.expires_at)
        return await self.settle_hold(extra, cost_nanos)

    async def status(self, principal: PrincipalLike) -> BudgetStatus:
        pairs = self._refs(await self.policies.for_principal(principal), self._clock())
        if not pairs:
            return UNLIMITED
        refs = [r for _, r in pairs]
        states = await self.counters.snapshot(refs, self._load)
        return self._tightest(list(zip(refs, states, strict=True)))

    async def statuses(self, policies: Sequence[BudgetPolicy]) -> dict[str, BudgetStatus]:
        """The status of each given policy on its own (by subject), read from the counters in one
        snapshot: for views of many subjects at once (the admin overview), whose policies the
        caller read in one query. Policies without a limit are left out."""
        pairs = self._refs(policies, self._clock())
        if not pairs:
            return {}
        refs = [r for _, r in pairs]
        states = await self.counters.snapshot(refs, self._load)
        return {ref.subject: self._tightest([(ref, st)]) for ref, st in zip(refs, states, strict=True)}

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
            remaining_nanos=s.remaining(ref.limit_nanos) if hard else None, soft_exceeded=soft,
            hard_limit_nanos=ref.limit_nanos if hard else None,
            soft_limit_nanos=None if p is None else p.soft_limit_nanos,
            spent_nanos=s.spent_nanos, held_nanos=s.held_nanos, subject=ref.subject,
            period=ref.window.period, period_key=ref.window.key,
            resets_in_s=ref.window.seconds_left(self._clock()))
