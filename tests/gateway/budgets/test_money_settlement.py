"""Budget settlements equal the ledger, exactly, over many random calls (fixed seeds).

Prices here have fractional nano-USD per token (e.g. 12.3 nano-USD per input token), the case
in which a float cost summed one way and rounded another used to drift by a few nano-USD. Now a
call's cost is rounded once, to integer nano-USD, and the same integer goes to the ledger row,
to the request's spend and to the budget settlement — so the spend counter equals the sum of
the ledger rows with no tolerance, whatever mix of holds, top-ups, failed calls, cancelled
holds and uncovered costs a request goes through."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from gateway.budgets import BudgetPolicy, BudgetRuntime, build_budget_runtime
from gateway.chat.admission import Admitted
from gateway.chat.spend import Spend
from gateway.ledger import cost_nanos_for
from gateway.pipeline import RequestContext
from gateway.providers.base import Usage
from gateway.settings import Settings, settings_from_dict
from tests.gateway.budgets_support import Caller
from tests.gateway.routing_support import plan_of
from tests.gateway.scripted_models import ScriptedProvider, harness, plan_json, scripted_settings

ODD_PRICES = {"small": {"input": 0.0123, "output": 0.0457}, "mid": {"input": 0.333, "output": 1.777},
              "big": {"input": 2.5001, "cached_input": 1.2345, "output": 10.0003}}
LIMIT = 10**15  # far away: these tests are about exactness, not refusals


def odd_settings() -> Settings:
    cfg: dict[str, Any] = scripted_settings().model_dump(exclude={"base_dir"})
    for name, price in ODD_PRICES.items():
        cfg["models"][name]["price"] = price
    return settings_from_dict(cfg)


def runtime(settings: Settings, limit: int = LIMIT) -> BudgetRuntime:
    rt = build_budget_runtime(settings, None)  # in-process counters, no database
    rt.budgets.policies.set_override(BudgetPolicy("tenant:t1", "tenant", "t1", None, "month", limit_nanos=limit))
    return rt


async def _spent(rt: BudgetRuntime, caller: Caller) -> tuple[int, int]:
    status = await rt.budgets.status(caller)
    return status.spent_nanos, status.held_nanos


@pytest.mark.parametrize("seed", range(12))
async def test_random_calls_settle_to_exactly_their_ledger_rows(seed: int) -> None:
    """One request's calls in random shapes: held then settled (concurrently, in random order),
    failed (settled to 0), never settled (released at close), or billed with no hold at all."""
    rng = random.Random(seed)
    settings = odd_settings()
    rt = runtime(settings)
    caller = Caller("t1", "k1")
    gate = Admitted(rt.budgets, caller, "r1", await rt.budgets.reserve(caller, rng.randint(0, 10**6),
                                                                     request_id="r1"), {})
    await gate.meter_per_call()
    ledger: list[int] = []

    async def call(tier: str, model: str) -> None:
        usage = Usage(prompt_tokens=rng.randint(1, 4000), completion_tokens=rng.randint(0, 2000),
                      cached_tokens=rng.randint(0, 50))
        worst = settings.tier_price(tier).nanos(usage.prompt_tokens, 0, 2000 + 100)
        cost, _ = cost_nanos_for(settings, tier, model, usage)
        shape = rng.random()
        if shape < 0.1:  # billed, but no hold covered it (charged when the request closes)
            ledger.append(cost)
            return
        hold = await gate.hold(worst)
        await asyncio.sleep(rng.random() / 1000)
        if shape < 0.2:  # the call failed before costing anything
            await hold.settle(0)
        elif shape < 0.3:  # left open: close() releases it
            return
        else:
            ledger.append(cost)
            await hold.settle(cost)

    tiers = [("low", "small"), ("medium", "mid"), ("high", "big")]
    await asyncio.gather(*(call(*rng.choice(tiers)) for _ in range(rng.randint(1, 40))))
    await gate.close(Spend(cost_nanos=sum(ledger)))
    assert await _spent(rt, caller) == (sum(ledger), 0)


@pytest.mark.parametrize("seed", range(6))
async def test_concurrent_requests_spend_exactly_their_ledger_rows(seed: int) -> None:
    rng = random.Random(seed)
    settings = odd_settings()
    rt = runtime(settings)
    caller = Caller("t1")
    total = 0

    async def request(i: int) -> None:
        nonlocal total
        gate = Admitted(rt.budgets, caller, f"r{i}", await rt.budgets.reserve(caller, 1000, request_id=f"r{i}"), {})
        await gate.meter_per_call()
        cost = 0
        for _ in range(rng.randint(0, 6)):
            usage = Usage(prompt_tokens=rng.randint(1, 3000), completion_tokens=rng.randint(1, 900))
            hold = await gate.hold(settings.tier_price("high").nanos(usage.prompt_tokens, 0, 1000))
            row = cost_nanos_for(settings, "high", "big", usage)[0]
            cost += row
            await hold.settle(row)
        await gate.close(Spend(cost_nanos=cost))
        total += cost

    await asyncio.gather(*(request(i) for i in range(30)))
    assert await _spent(rt, caller) == (total, 0)


@pytest.mark.parametrize("seed", range(6))
async def test_the_pipeline_settles_every_call_to_its_ledger_rows_exactly(seed: int) -> None:
    """The real pipeline (plan, steps, reviews with revise rounds) over scripted models with random
    reply lengths, its holds on real budgets: spend counter == sum of its ledger rows."""
    rng = random.Random(seed)
    settings = odd_settings()
    steps = [(f"s{i}", f"step {i}", [f"s{i - 1}"] if i and rng.random() < 0.5 else []) for i in range(rng.randint(1, 4))]
    reviews = ["VERDICT: revise\nFAILING: s0\nANSWER:\ndraft"] * rng.randint(0, 2) + ["VERDICT: accept\nANSWER:\nok"]
    provider = ScriptedProvider(plans=[plan_json(*steps)], reviews=reviews,
                                step=lambda m, t: " ".join(["w"] * rng.randint(1, 60)))
    h = harness(provider, settings)
    rt = runtime(settings)
    caller = Caller("t1", "k1")
    ctx = RequestContext(request_id="r-pipe", tenant_id="t1", key_id="k1")
    gate = Admitted(rt.budgets, caller, ctx.request_id, await rt.budgets.reserve(caller, 5_000), {})
    await gate.meter_per_call()
    h.pipeline.call_budget = gate
    body = {"model": "auto", "reasoning_effort": rng.choice(["high", "xhigh"]),
            "messages": [{"role": "user", "content": "x " * rng.randint(1, 400)}]}
    if body["reasoning_effort"] == "xhigh":
        provider.paths = {i: ("a b c d e f g h i j", [-0.1 * (i + 1)] * 10) for i in range(3)}
    result = await h.pipeline.run(ctx, body, plan_of(settings, body, None))
    rows = sum(e.cost_nanos for e in h.entries)
    assert result.cost_nanos == rows > 0
    assert sum(hold.settled_nanos or 0 for hold in gate.holds) == rows  # every call settled to its rows
    await gate.close(Spend(cost_nanos=rows))
    assert await _spent(rt, caller) == (rows, 0)
