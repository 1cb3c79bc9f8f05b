"""The plain data of budget holds and the contract of the counters that hold them.

- ``Hold``: nano-USD held on a caller's budget counters while upstream work runs — the one hold
  type of tiergate (the request's admission hold and every per-call hold are ``Hold``s).
  ``Budgets.reserve`` returns one: the worst case of the work it covers, held atomically on every
  budget counter of the caller (tenant's and key's), or ``BudgetExceeded``. A hold ends exactly
  once, by ``settle(cost_nanos)`` (the hold is replaced by what the work cost; 0 gives it all
  back) or ``release()`` (gives it all back). Ending is idempotent (a later call waits for the
  first and returns its outcome) and runs to completion even when the caller is cancelled: the
  counter update is a task the caller only waits for (shielded). ``cover(nanos)`` grows a hold
  that is still open to ``nanos`` by reserving the difference as a top-up, which ends with it (a
  request's admission hold becoming its first call's hold).
- ``CounterBackend``: what both counter backends (in-process, Redis) implement. A counter is
  ``spent`` (settled nano-USD in one subject's period window, loaded from the database on first
  use) plus ``held`` (outstanding holds). Reserving checks ``spent + held + amount <= limit`` for
  every counter of a hold atomically and holds on all of them or on none.
- ``BudgetStatus``: the tightest budget applying to a caller right now, and its edge forms (the
  ``x-tiergate-budget-remaining-usd`` header, the admin API's JSON in USD).

Amounts are integer nano-USD (``gateway.money``), so a settlement equals the ledger rows it
stands for to the last nano. Must not import routes, the app, the pipeline or providers.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from gateway.budgets.periods import PeriodName, PeriodWindow
from gateway.budgets.policies import PrincipalLike
from gateway.money import format_usd, usd_number

REMAINING_HEADER = "x-tiergate-budget-remaining-usd"


def remaining_headers(remaining_nanos: int | None) -> dict[str, str]:
    """The remaining-budget header (never negative), or none when no hard limit applies."""
    return {} if remaining_nanos is None else {REMAINING_HEADER: format_usd(max(remaining_nanos, 0))}


def _usd(nanos: int | None) -> float | None:
    return None if nanos is None else usd_number(nanos)


@dataclass(frozen=True)
class BudgetStatus:
    """The tightest budget applying to a caller right now (None fields: no limit set)."""

    remaining_nanos: int | None
    soft_exceeded: bool
    hard_limit_nanos: int | None
    soft_limit_nanos: int | None = None
    spent_nanos: int = 0
    held_nanos: int = 0
    subject: str | None = None
    period: PeriodName | None = None
    period_key: str | None = None
    resets_in_s: float | None = None

    def headers(self) -> dict[str, str]:
        return remaining_headers(self.remaining_nanos)

    def to_json(self) -> dict[str, Any]:
        """The admin API's and dashboard's form: amounts as USD numbers."""
        return {"remaining_usd": _usd(self.remaining_nanos), "soft_exceeded": self.soft_exceeded,
                "hard_limit_usd": _usd(self.hard_limit_nanos), "soft_limit_usd": _usd(self.soft_limit_nanos),
                "spent_usd": usd_number(self.spent_nanos), "held_usd": usd_number(self.held_nanos),
                "subject": self.subject, "period": self.period, "period_key": self.period_key,
                "resets_in_s": self.resets_in_s}


UNLIMITED = BudgetStatus(remaining_nanos=None, soft_exceeded=False, hard_limit_nanos=None)


_END_ORDER = itertools.count(1)


@dataclass(frozen=True)
class CounterRef:
    """One budget counter a hold holds against: a subject in one period window."""

    subject: str  # "tenant:<id>" | "key:<id>"
    scope: str  # "tenant" | "key"
    tenant_id: str
    key_id: str | None
    window: PeriodWindow
    limit_nanos: int

    @property
    def key(self) -> str:
        return f"{self.subject}|{self.window.key}"


class HoldOwner(Protocol):
    """What ends a hold (``gateway.budgets.Budgets``)."""

    async def reserve(self, principal: PrincipalLike, worst_case_nanos: int, *,
                      request_id: str | None = None) -> Hold: ...

    async def settle_hold(self, hold: Hold, cost_nanos: int) -> BudgetStatus: ...

    async def release_hold(self, hold: Hold) -> None: ...


@dataclass(eq=False)
class Hold:
    """``amount_nanos`` held on ``counters`` until ``expires_at`` (the lease, for a process that
    dies holding it). ``remaining_nanos``: the tightest remaining hard budget right after
    reserving (None: no hard limit)."""

    id: str
    tenant_id: str
    key_id: str | None
    request_id: str | None
    counters: tuple[CounterRef, ...]
    amount_nanos: int
    created_at: datetime
    expires_at: datetime
    remaining_nanos: int | None = None
    owner: HoldOwner | None = field(default=None, repr=False)
    top_ups: list[Hold] = field(default_factory=list, repr=False)
    settled_nanos: int | None = None  # once ended: what it charged (0 when released)
    status: BudgetStatus | None = None  # after a settlement that charged something
    end_order: int = 0  # increases with the time the hold ended (0: not ended)
    _ending: asyncio.Future[None] | None = field(default=None, init=False, repr=False)
    _ended_in_place: bool = field(default=False, init=False, repr=False)

    @property
    def ended(self) -> bool:
        return self._ending is not None or self._ended_in_place

    @property
    def holds_nothing(self) -> bool:
        """On no counter (no budget of the caller has a limit) and not topped up: ending it updates
        nothing, so it ends in place (no task, no suspension)."""
        return not self.counters and not self.top_ups

    @property
    def held_nanos(self) -> int:
        """What this hold holds, top-ups included."""
        return self.amount_nanos + sum(t.amount_nanos for t in self.top_ups)

    async def cover(self, nanos: int) -> None:
        """Hold at least ``nanos`` in all, reserving the difference as a top-up (``BudgetExceeded``
        when the budget cannot hold it; the hold itself is left as it was)."""
        if self.ended:
            raise RuntimeError("a hold that has ended cannot grow")
        extra = nanos - self.held_nanos
        if extra > 0:
            self.top_ups.append(await self._owner().reserve(self, extra, request_id=self.request_id))

    async def settle(self, cost_nanos: int) -> BudgetStatus | None:
        """Replace the hold by ``cost_nanos`` of spend (``<= 0``: release it); top-ups are released.
        Returns the caller's budget status afterwards (None when nothing was charged)."""
        return await self._end(max(cost_nanos, 0))

    async def release(self) -> None:
        """Give the whole hold back (a no-op, after waiting for it, when it has already ended)."""
        await self._end(0)

    async def _end(self, cost_nanos: int) -> BudgetStatus | None:
        if self._ended_in_place:
            return self.status
        if self._ending is None:
            if self.holds_nothing:  # what Budgets.settle_hold / release_hold do for it, without a task
                self._ended_in_place = True
                self._record_end(cost_nanos, UNLIMITED if cost_nanos > 0 else None)
                return self.status
            self._ending = asyncio.ensure_future(self._apply(cost_nanos))
        await asyncio.shield(self._ending)
        return self.status

    def _record_end(self, cost_nanos: int, status: BudgetStatus | None) -> None:
        if status is not None:
            self.status = status
        self.settled_nanos = cost_nanos
        self.end_order = next(_END_ORDER)

    async def _apply(self, cost_nanos: int) -> None:
        owner = self._owner()
        try:
            status = None
            if cost_nanos > 0:
                status = await owner.settle_hold(self, cost_nanos)
            else:
                await owner.release_hold(self)
            self._record_end(cost_nanos, status)
        finally:
            for top_up in self.top_ups:
                await top_up.release()

    def _owner(self) -> HoldOwner:
        if self.owner is None:
            raise RuntimeError("this hold was not made by Budgets.reserve")
        return self.owner


SpentLoader = Callable[[CounterRef], Awaitable[int]]


@dataclass(frozen=True)
class CounterState:
    spent_nanos: int
    held_nanos: int

    def remaining(self, limit_nanos: int) -> int:
        return limit_nanos - self.spent_nanos - self.held_nanos


@dataclass(frozen=True)
class ReserveOutcome:
    ok: bool
    states: tuple[CounterState, ...]  # one per counter, after the hold when ok
    denied_index: int | None = None  # which counter refused


class CounterBackend(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def reserve(self, hold: Hold, load: SpentLoader) -> ReserveOutcome: ...

    async def settle(self, hold: Hold, actual_nanos: int) -> tuple[CounterState, ...]: ...

    async def release(self, hold: Hold) -> None: ...

    async def snapshot(self, refs: Sequence[CounterRef], load: SpentLoader) -> tuple[CounterState, ...]: ...
