"""``Hold``: nano-USD held on a caller's budget counters while upstream work runs — the one
hold type of tiergate (the request's admission hold and every per-call hold are ``Hold``s).

``Budgets.reserve`` returns one: the worst case of the work it covers, held atomically on every
budget counter of the caller (tenant's and key's), or ``BudgetExceeded``. A hold ends exactly
once, by ``settle(cost_nanos)`` (the hold is replaced by what the work cost; 0 gives it all
back) or ``release()`` (gives it all back). Ending is idempotent (a later call waits for the
first and returns its outcome) and runs to completion even when the caller is cancelled: the
counter update is a task the caller only waits for (shielded). ``cover(nanos)`` grows a hold
that is still open to ``nanos`` by reserving the difference as a top-up, which ends with it (a
request's admission hold becoming its first call's hold).

Amounts are integer nano-USD (``gateway.money``), so a settlement equals the ledger rows it
stands for to the last nano. Must not import routes, the app, the pipeline or providers.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from gateway.budgets.periods import PeriodWindow
from gateway.budgets.policies import PrincipalLike
from gateway.budgets.status import BudgetStatus

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

    @property
    def ended(self) -> bool:
        return self._ending is not None

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
        if self._ending is None:
            self._ending = asyncio.ensure_future(self._apply(cost_nanos))
        await asyncio.shield(self._ending)
        return self.status

    async def _apply(self, cost_nanos: int) -> None:
        owner = self._owner()
        try:
            if cost_nanos > 0:
                self.status = await owner.settle_hold(self, cost_nanos)
            else:
                await owner.release_hold(self)
            self.settled_nanos = cost_nanos
            self.end_order = next(_END_ORDER)
        finally:
            for top_up in self.top_ups:
                await top_up.release()

    def _owner(self) -> HoldOwner:
        if self.owner is None:
            raise RuntimeError("this hold was not made by Budgets.reserve")
        return self.owner
