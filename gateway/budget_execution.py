"""``BudgetedExecutor``: budgets and rate limits around any chat ``Executor``.

Wraps the executor the chat route calls (direct or pipeline): checks the caller's rate
limits (requests/min and tokens/min), reserves the worst-case cost of the request's first
upstream call on every budget of the tenant and key (429 ``budget_exceeded`` when it does
not fit), and settles the hold to what the request actually cost (``tally.cost_nanos``, the
same integer nano-USD the executor wrote to the ledger) when the answer or the stream ends —
including failures and cancellations that still cost tokens; a request that cost nothing
releases its hold. The inner executor gets a ``RequestBudget`` (``req.call_budget``): one that
makes several calls (the pipeline) switches it to per-call holds, so every call is covered by
a reservation of its own worst case and settled to its own cost. ``x-tiergate-budget-remaining-usd`` is left in ``tally.response_headers``
for the route.

Imports the execution hook, budgets, ledger pricing and settings; no FastAPI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from gateway.budgets import Budgets, Hold, RateLimiter, remaining_headers
from gateway.execution import Executor, ResolvedRequest
from gateway.ledger.pricing import model_price, price_for
from gateway.providers.metering import prompt_token_bound
from gateway.request_budget import RequestBudget
from gateway.resolve import AUTO_MODEL
from gateway.settings import Settings


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class BudgetedExecutor:
    def __init__(self, settings: Settings, inner: Executor, budgets: Budgets,
                 rate_limiter: RateLimiter | None = None) -> None:
        self.settings, self.inner, self.budgets, self.rate_limiter = settings, inner, budgets, rate_limiter

    def max_output(self, req: ResolvedRequest) -> int | None:
        """What one choice of the request's call may generate (None: up to the context window)."""
        res = req.resolution
        max_out = _max_tokens(req.body)  # ChatFlow bounded it by the tier's (or model's) cap
        tier = self.settings.tiers.get(res.tier)  # type: ignore[call-overload]
        if tier is not None and res.requested_model == AUTO_MODEL and tier.engine.thinking_budget_tokens:
            # routed by effort: a thinking call may generate its answer plus the tier's thinking budget
            max_out = (max_out or tier.max_output_tokens) + tier.engine.thinking_budget_tokens
        return max_out

    def worst_case(self, req: ResolvedRequest) -> tuple[int, int]:
        """(worst-case nano-USD of the request's call over its model chain, tokens for the tokens/min
        limit). Covers everything the upstream can be asked to generate: every one of the ``n``
        choices at its output cap (the context window when nothing caps it), on a prompt bounded
        from its bytes (``prompt_token_bound``), at the dearest price of the chain."""
        res, body = req.resolution, req.body
        n = body.get("n") or 1
        max_out = self.max_output(req)
        price_tier = res.price_tier(self.settings)
        worst, tokens = 0, 0
        for name in res.models:
            model = self.settings.models[name]
            price = price_for(self.settings, price_tier, name) if price_tier else model_price(model)
            prompt = prompt_token_bound(model, body)
            out = n * min(max_out or model.context_window, model.context_window)  # no choice outgrows the window
            worst = max(worst, price.nanos(prompt, 0, out))
            tokens = max(tokens, prompt + out)
        return worst, tokens

    async def _open(self, req: ResolvedRequest) -> Hold:
        policies = await self.budgets.policies.for_principal(req)  # cached; no tokenizing when unlimited
        needs_cost = any(p.limit_nanos is not None or p.soft_limit_nanos is not None or p.tokens_per_min
                         for p in policies)
        worst, tokens = self.worst_case(req) if needs_cost else (0, 0)
        if self.rate_limiter is not None:
            await self.rate_limiter.check(req, tokens)
        reservation = await self.budgets.reserve(req, worst, request_id=req.request_id)
        _headers(req).update(remaining_headers(reservation.remaining_nanos))
        return reservation

    def _with_budget(self, req: ResolvedRequest, reservation: Hold) -> ResolvedRequest:
        gate = RequestBudget(self.budgets, req, req.request_id, reservation)
        return dataclasses.replace(req, call_budget=gate)

    async def _close(self, req: ResolvedRequest, reservation: Hold) -> None:
        """Settle to the request's actual cost (or release when it cost nothing). Shielded."""
        cost = req.tally.cost_nanos
        gate = req.call_budget
        if isinstance(gate, RequestBudget) and gate.metered:  # the executor settled per call
            status = await gate.close(cost)
        else:
            status = await reservation.settle(cost)  # 0: released
        if status is not None:
            _headers(req).update(status.headers())

    async def complete(self, req: ResolvedRequest) -> dict[str, Any]:
        reservation = await self._open(req)
        req = self._with_budget(req, reservation)
        try:
            return await self.inner.complete(req)
        finally:
            await self._close(req, reservation)

    async def stream(self, req: ResolvedRequest) -> AsyncIterator[dict[str, Any]]:
        reservation = await self._open(req)
        req = self._with_budget(req, reservation)
        try:
            chunks = await self.inner.stream(req)
        except BaseException:
            await self._close(req, reservation)
            raise
        return self._guarded(req, reservation, chunks)

    async def _guarded(self, req: ResolvedRequest, reservation: Hold,
                       chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            try:
                aclose = getattr(chunks, "aclose", None)
                if aclose is not None:
                    await aclose()  # the inner stream bills what was generated
            finally:
                await self._close(req, reservation)


def _headers(req: ResolvedRequest) -> dict[str, str]:
    return req.tally.response_headers
