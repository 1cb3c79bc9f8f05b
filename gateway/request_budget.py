"""``RequestBudget``: the per-call budget holds of one request (``gateway.execution.CallBudget``).

``BudgetedExecutor`` reserves the worst case of a request's first upstream call before running
it (the admission check: 429 ``budget_exceeded`` before anything is spent). A direct request
makes one call and is settled as a whole. An executor that makes several calls (the pipeline)
calls ``meter_per_call`` and then ``hold``s each call's worst case before making it: the first
hold is the admission hold topped up to that call's worst case (so the budget is never let go
between admission and the first call), every later one is a ``Hold`` of its own. Each hold is
settled to what its call cost, in integer nano-USD summed over the call's ledger rows, so the
budget counter moves by exactly what the ledger records. ``hold`` raises ``BudgetExceeded``
when the budget cannot hold the call; the caller decides what that means (the pipeline stops
early).

Money path: settle/release errors propagate. Imports budgets only; no FastAPI, no pipeline.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from gateway.budgets import Budgets, BudgetStatus, Hold
from gateway.budgets.policies import PrincipalLike

log = logging.getLogger(__name__)


@dataclass
class RequestBudget:
    budgets: Budgets
    principal: PrincipalLike
    request_id: str
    admission: Hold  # taken by BudgetedExecutor before the request ran
    metered: bool = False  # True once the executor meters per call
    admission_used: bool = False  # the admission hold is (or was) a call's hold
    status: BudgetStatus | None = None  # after the latest settlement
    holds: list[Hold] = field(default_factory=list)

    async def meter_per_call(self) -> None:
        self.metered = True

    async def hold(self, worst_case_nanos: int) -> Hold:
        """Hold ``worst_case_nanos`` for the next call, or raise ``BudgetExceeded``."""
        if not self.metered:
            raise RuntimeError("meter_per_call() first: a direct request is settled as a whole")
        want = max(worst_case_nanos, 0)
        if not self.admission_used:
            self.admission_used = True
            hold = self.admission
            try:
                await hold.cover(want)
            except BaseException:
                await hold.release()
                raise
        else:
            hold = await self.budgets.reserve(self.principal, want, request_id=self.request_id)
        self.holds.append(hold)
        return hold

    async def close(self, request_cost_nanos: int) -> BudgetStatus | None:
        """At the end of a metered request: release holds still open (their calls never ran or
        were never settled; a settlement still in flight is waited for), then charge any cost no
        settlement covered, so the counter ends equal to the request's ledger rows, exactly.
        Returns the latest status."""
        for hold in self.holds:
            await hold.release()
        if not self.admission_used:
            await self.admission.release()
        settled = [h for h in self.holds if h.status is not None]
        if settled:
            self.status = max(settled, key=lambda h: h.end_order).status
        uncovered = request_cost_nanos - sum(h.settled_nanos or 0 for h in self.holds)
        if uncovered > 0:  # a call no hold covered
            self.status = await asyncio.shield(self.budgets.charge(self.admission, uncovered))
        elif uncovered < 0:
            log.error("request %s: holds settled %d nano-USD more than its ledger rows", self.request_id,
                      -uncovered)
        return self.status
