"""``budget_guard``: the one call the request path makes around an upstream call.

    async with budget_guard(budgets, limiter, principal, worst_case_usd, tokens,
                            request_id=rid) as guard:
        response = await call_upstream(...)
        ledger.record(...)                     # the same cost
        await guard.settle(actual_cost_usd)
    headers.update(guard.headers())

Rate limits are checked first (nothing reserved when they refuse), then the worst case
is reserved; leaving the block without ``settle`` (exception, client disconnect,
cancellation) releases the hold. Must not import routes, the app or the pipeline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.budgets.policies import PrincipalLike
from gateway.budgets.rate_limit import RateLimiter
from gateway.budgets.reservations import Reservation
from gateway.budgets.service import REMAINING_HEADER, Budgets, BudgetStatus


class BudgetGuard:
    def __init__(self, budgets: Budgets, reservation: Reservation) -> None:
        self._budgets = budgets
        self.reservation = reservation
        self.status: BudgetStatus | None = None
        self.settled = False

    async def settle(self, actual_usd: float) -> BudgetStatus:
        if self.settled:
            raise RuntimeError("reservation already settled")
        self.settled = True
        self.status = await self._budgets.settle(self.reservation, actual_usd)
        return self.status

    def headers(self) -> dict[str, str]:
        if self.status is not None:
            return self.status.headers()
        left = self.reservation.remaining_usd
        return {} if left is None else {REMAINING_HEADER: f"{max(left, 0.0):.9f}"}


@asynccontextmanager
async def budget_guard(budgets: Budgets, rate_limiter: RateLimiter | None, principal: PrincipalLike,
                       worst_case_usd: float, tokens: int, *,
                       request_id: str | None = None) -> AsyncIterator[BudgetGuard]:
    if rate_limiter is not None:
        await rate_limiter.check(principal, tokens)
    reservation = await budgets.reserve(principal, worst_case_usd, request_id=request_id)
    guard = BudgetGuard(budgets, reservation)
    try:
        yield guard
    finally:
        if not guard.settled:
            # Shielded: a cancelled request must still give its hold back.
            await asyncio.shield(budgets.release(reservation))
