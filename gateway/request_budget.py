"""``RequestBudget``: the per-call budget holds of one request (``gateway.execution.CallBudget``).

``BudgetedExecutor`` reserves the worst case of a request's first upstream call before running
it (the admission check: 429 ``budget_exceeded`` before anything is spent). A direct request
makes one call and is settled as a whole. An executor that makes several calls (the pipeline)
calls ``meter_per_call`` and then ``hold``s each call's worst case before making it: the first
hold tops the admission reservation up (so the budget is never let go between admission and the
first call), every later one is a reservation of its own. Each hold is settled to what its call
cost, in integer nano-USD summed over the call's ledger rows, so the budget counter moves by
exactly what the ledger records. ``hold`` raises ``BudgetExceeded`` when the budget cannot hold
the call; the caller decides what that means (the pipeline stops early).

Money path: settle/release errors propagate. Imports budgets only; no FastAPI, no pipeline.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from gateway.budgets import Budgets, BudgetStatus, Reservation, from_nanos, to_nanos
from gateway.budgets.policies import PrincipalLike


@dataclass
class _Hold:
    """One call's hold: one reservation, or the admission reservation plus a top-up."""

    budget: RequestBudget
    reservations: tuple[Reservation, ...]
    done: bool = False

    async def settle(self, cost_nanos: int) -> None:
        if self.done:
            return
        self.done = True
        task = asyncio.ensure_future(self.budget.settle_reservations(self.reservations, cost_nanos))
        self.budget.settling.add(task)  # close() waits for it even if this caller is cancelled
        task.add_done_callback(self.budget.settling.discard)
        await asyncio.shield(task)


@dataclass
class RequestBudget:
    budgets: Budgets
    principal: PrincipalLike
    request_id: str
    admission: Reservation  # taken by BudgetedExecutor before the request ran
    metered: bool = False  # True once the executor meters per call
    admission_used: bool = False  # the admission reservation is (or was) a call's hold
    settled_nanos: int = 0  # what per-call settlements have charged so far
    status: BudgetStatus | None = None  # after the latest settlement
    holds: list[_Hold] = field(default_factory=list)
    settling: set[asyncio.Future[None]] = field(default_factory=set)  # settlements in flight

    async def meter_per_call(self) -> None:
        self.metered = True

    async def hold(self, worst_case_usd: float) -> _Hold:
        """Hold ``worst_case_usd`` for the next call, or raise ``BudgetExceeded``."""
        if not self.metered:
            raise RuntimeError("meter_per_call() first: a direct request is settled as a whole")
        want = max(to_nanos(worst_case_usd), 0)
        if not self.admission_used:
            self.admission_used = True
            extra = want - self.admission.amount_nanos
            reservations: tuple[Reservation, ...] = (self.admission,)
            if extra > 0:
                try:
                    reservations += (await self._reserve(from_nanos(extra)),)
                except BaseException:
                    await asyncio.shield(self.budgets.release(self.admission))
                    raise
        else:
            reservations = (await self._reserve(worst_case_usd),)
        hold = _Hold(self, reservations)
        self.holds.append(hold)
        return hold

    async def _reserve(self, usd: float) -> Reservation:
        return await self.budgets.reserve(self.principal, usd, request_id=self.request_id)

    async def settle_reservations(self, reservations: tuple[Reservation, ...], cost_nanos: int) -> None:
        """Charge ``cost_nanos`` on the first reservation (releasing any top-up), or release all."""
        first, *rest = reservations
        try:
            if cost_nanos > 0:
                self.status = await self.budgets.settle(first, from_nanos(cost_nanos))
                self.settled_nanos += cost_nanos
            else:
                await self.budgets.release(first)
        finally:
            for res in rest:
                await self.budgets.release(res)

    async def close(self, request_cost_usd: float) -> BudgetStatus | None:
        """At the end of a metered request: release holds still open (their calls never ran or
        were never settled) and charge any cost no per-call settlement covered, so the counter
        ends equal to the request's ledger rows. Returns the latest status."""
        for hold in self.holds:
            if not hold.done:
                await hold.settle(0)
        if self.settling:  # a cancelled call's shielded settlement: count it before comparing
            await asyncio.shield(asyncio.gather(*self.settling))
        if not self.admission_used:
            await asyncio.shield(self.budgets.release(self.admission))
        uncovered = to_nanos(request_cost_usd) - self.settled_nanos
        if uncovered > len(self.holds) + 1:  # more than per-row rounding: a call no hold covered
            self.status = await asyncio.shield(self.budgets.settle(
                _no_hold(self.admission), from_nanos(uncovered)))
            self.settled_nanos += uncovered
        return self.status


def _no_hold(res: Reservation) -> Reservation:
    """A settlement-only reservation: its id holds nothing, so settling only adds spend."""
    return replace(res, id=res.id + "-uncovered", amount_nanos=0)
