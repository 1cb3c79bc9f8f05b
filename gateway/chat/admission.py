"""Admission: budgets and rate limits in front of every chat request.

``Admission.admit`` checks the caller's rate limits (requests/min, tokens/min) and holds the
worst case of the request's first upstream call on every budget of its tenant and key (429
``budget_exceeded`` before anything is spent). The worst case is sized on the ``RouteDecision``
— the tier that will run, after any soft-budget cap — and covers everything the upstream can be
asked to generate: each of the ``n`` choices at the output cap sent upstream (the context window
when nothing caps it), on a prompt bounded from its bytes, at the dearest price of the chain.

The ``Admitted`` request settles the hold to exactly what its ledger rows cost (the request's
``Spend``) when the answer or the stream ends — failures and cancellations that cost tokens
included; a request that cost nothing releases it. An executor that makes several calls (the
pipeline) uses ``Admitted`` as its ``CallBudget``: it holds each call's worst case before making
it — the first hold tops the admission hold up, so the budget is never let go between admission
and the first call — and each hold is settled to its call's rows. ``headers`` carries
``x-tiergate-budget-remaining-usd`` for the route.

Money path: settle/release errors propagate. Imports budgets, pricing, metering, routing and the
chat types; no FastAPI.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from gateway.budgets import Budgets, BudgetStatus, Hold, RateLimiter
from gateway.budgets.holds import remaining_headers
from gateway.budgets.policies import PrincipalLike
from gateway.chat.request import ChatRequest
from gateway.chat.spend import Spend, SpendStream
from gateway.ledger.pricing import model_price, price_for
from gateway.providers.metering import prompt_token_bound
from gateway.routing import AUTO_MODEL
from gateway.settings import Settings

log = logging.getLogger(__name__)


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class Admission:
    def __init__(self, settings: Settings, budgets: Budgets, rate_limiter: RateLimiter | None = None) -> None:
        self.settings, self.budgets, self.rate_limiter = settings, budgets, rate_limiter

    async def soft_exceeded(self, principal: PrincipalLike) -> bool:
        """Is the caller past a soft budget (its effort is then capped)? No counter is read unless
        one of its policies has a soft limit (the policies are cached)."""
        policies = await self.budgets.policies.for_principal(principal)
        if not any(p.soft_limit_nanos is not None for p in policies):
            return False
        return (await self.budgets.status(principal)).soft_exceeded

    def max_output(self, req: ChatRequest) -> int | None:
        """What one choice of the request's call may generate (None: up to the context window)."""
        d = req.decision
        max_out = _max_tokens(d.body)  # the decision bounded it by the tier's (or model's) cap
        tier = self.settings.tiers.get(d.tier)  # type: ignore[call-overload]
        if tier is not None and d.requested_model == AUTO_MODEL and tier.engine.thinking_budget_tokens \
                and d.uses_pipeline:
            # a pipeline's first call may think within the review tier's budget before it answers
            max_out = (max_out or tier.max_output_tokens) + tier.engine.thinking_budget_tokens
        return max_out

    def worst_case(self, req: ChatRequest) -> tuple[int, int]:
        """(worst-case nano-USD of the request's call over its model chain, tokens for the
        tokens/min limit)."""
        d = req.decision
        n = d.body.get("n") or 1
        max_out = self.max_output(req)
        price_tier = d.price_tier(self.settings)
        worst, tokens = 0, 0
        for name in d.models:
            model = self.settings.models[name]
            price = price_for(self.settings, price_tier, name) if price_tier else model_price(model)
            prompt = prompt_token_bound(model, d.body)
            out = n * min(max_out or model.context_window, model.context_window)  # no choice outgrows the window
            worst = max(worst, price.nanos(prompt, 0, out))
            tokens = max(tokens, prompt + out)
        return worst, tokens

    async def admit(self, req: ChatRequest, *, rate_limited: bool = True) -> Admitted:
        """Hold the request's worst case (and count it against the rate limits), or raise
        ``BudgetExceeded`` / ``RateLimited``."""
        who = _Principal(req.tenant_id, req.key_id)
        policies = await self.budgets.policies.for_principal(who)  # cached; no tokenizing when unlimited
        needs_cost = any(p.limit_nanos is not None or p.soft_limit_nanos is not None or p.tokens_per_min
                         for p in policies)
        worst, tokens = self.worst_case(req) if needs_cost else (0, 0)
        if rate_limited and self.rate_limiter is not None:
            await self.rate_limiter.check(who, tokens)
        hold = await self.budgets.reserve(who, worst, request_id=req.request_id)
        return Admitted(self.budgets, who, req.request_id, hold, remaining_headers(hold.remaining_nanos))


class _Principal:
    __slots__ = ("key_id", "tenant_id")

    def __init__(self, tenant_id: str, key_id: str | None) -> None:
        self.tenant_id, self.key_id = tenant_id, key_id


class Admitted:
    """One admitted request: its admission hold, the per-call holds of a pipeline
    (``gateway.pipeline.types.CallBudget``), and the headers for the route."""

    def __init__(self, budgets: Budgets, principal: PrincipalLike, request_id: str, admission: Hold,
                 headers: dict[str, str]) -> None:
        self.budgets, self.principal, self.request_id, self.admission = budgets, principal, request_id, admission
        self.headers = headers
        self.metered = False  # True once an executor holds per call
        self.admission_used = False  # the admission hold is (or was) a call's hold
        self.holds: list[Hold] = []
        self.closed = False

    async def meter_per_call(self) -> None:
        self.metered = True

    async def hold(self, worst_case_nanos: int) -> Hold:
        """Hold ``worst_case_nanos`` for the pipeline's next call, or raise ``BudgetExceeded``."""
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

    async def close(self, spend: Spend) -> None:
        """Settle everything to ``spend`` (the request's ledger rows), exactly; once. Shielded."""
        if self.closed:
            return
        self.closed = True
        if not self.metered and self.admission.holds_nothing:  # ends in place: nothing to shield
            status = await self.admission.settle(spend.cost_nanos)
        else:
            status = await asyncio.shield(self._settle(spend.cost_nanos))
        if status is not None:
            self.headers.update(status.headers())

    async def _settle(self, cost_nanos: int) -> BudgetStatus | None:
        if not self.metered:  # one call, settled as a whole
            return await self.admission.settle(cost_nanos)  # 0: released
        for hold in self.holds:  # per-call holds still open: their calls never ran or never settled
            await hold.release()
        if not self.admission_used:
            await self.admission.release()
        settled = [h for h in self.holds if h.status is not None]
        status = max(settled, key=lambda h: h.end_order).status if settled else None
        uncovered = cost_nanos - sum(h.settled_nanos or 0 for h in self.holds)
        if uncovered > 0:  # a call no hold covered
            status = await self.budgets.charge(self.admission, uncovered)
        elif uncovered < 0:
            log.error("request %s: holds settled %d nano-USD more than its ledger rows", self.request_id,
                      -uncovered)
        return status


class AdmittedStream:
    """A stream whose admission is settled, to what the request's rows cost, once the stream has
    ended or was closed (``gateway.chat.spend`` close contract)."""

    def __init__(self, inner: SpendStream, admitted: Admitted, spent: Callable[[], Spend]) -> None:
        self.inner, self.admitted, self._spent = inner, admitted, spent  # every row of the request

    def __aiter__(self) -> AdmittedStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        try:
            return await self.inner.__anext__()
        except BaseException:
            await self.aclose()
            raise

    @property
    def spend(self) -> Spend:
        return self.inner.spend

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()  # cancels the upstream if it is still generating; bills it
        finally:
            await self.admitted.close(self._spent())
