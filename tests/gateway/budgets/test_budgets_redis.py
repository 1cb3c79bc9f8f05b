"""Budgets with the multi-replica backend: Redis Lua counters + PostgreSQL as the truth.

Two runtimes with their own Redis clients stand in for two replicas (the separate-process
versions live in test_budgets_processes.py)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from redis.asyncio import Redis

from gateway.budgets import BudgetRuntime, build_budget_runtime, put_policy
from gateway.budgets.outage import GuardedCounters
from gateway.budgets.redis_backend import RedisCounters
from gateway.errors import BudgetExceeded
from gateway.ledger import Ledger, LedgerEntry, new_entry_id
from gateway.providers.base import Usage
from tests.gateway.budgets_support import (
    Caller,
    FakeClock,
    W,
    budgeted_call,
    migrated_db,
    small_settings,
    usd,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
SETTINGS = small_settings()


@pytest.fixture
async def clients(redis_url: str, redis_prefix: str) -> AsyncIterator[list[Redis]]:
    made = [Redis.from_url(redis_url) for _ in range(2)]
    yield made
    async for key in made[0].scan_iter(match=redis_prefix + "*"):
        await made[0].delete(key)
    for c in made:
        await c.aclose()


def runtime(sf, client: Redis, prefix: str, clock=None, settings=SETTINGS) -> BudgetRuntime:  # type: ignore[no-untyped-def]
    kw = {"clock": clock} if clock else {}
    return build_budget_runtime(settings, sf, redis_client=client, redis_prefix=prefix,
                                reconcile_interval_s=0, **kw)


async def test_two_replicas_64_concurrent_against_budget_for_10(postgres_url: str, redis_prefix: str,
                                                                clients: list[Redis]) -> None:
    sf = migrated_db(postgres_url)
    with sf.begin() as s:
        put_policy(s, scope="tenant", tenant_id="t1", limit_usd=usd(W * 21 // 2))
    replicas = [runtime(sf, c, redis_prefix) for c in clients]
    for r in replicas:
        await r.start()
    caller = Caller("t1", "k1")
    outcomes: list[str] = []

    async def one(i: int) -> None:
        rt = replicas[i % 2]
        try:
            await budgeted_call(rt, caller, W, W, tokens=110, pause_s=random.random() / 100)
            outcomes.append("ok")
        except BudgetExceeded:
            outcomes.append("denied")

    await asyncio.gather(*(one(i) for i in range(64)))
    assert outcomes.count("ok") == 10 and outcomes.count("denied") == 54
    for rt in replicas:
        status = await rt.budgets.status(caller)
        assert (status.spent_nanos, status.held_nanos) == (10 * W, 0)
        with pytest.raises(BudgetExceeded):
            await rt.budgets.reserve(caller, W)
    for r in replicas:
        await r.stop()


async def test_dead_replica_reservations_expire_after_lease(postgres_url: str, redis_prefix: str,
                                                            clients: list[Redis]) -> None:
    sf = migrated_db(postgres_url)
    with sf.begin() as s:
        put_policy(s, scope="tenant", tenant_id="t1", limit_usd=usd(W * 3 // 2))
    settings = small_settings(reservation_lease_s=0.3)
    dead, alive = (runtime(sf, c, redis_prefix, settings=settings) for c in clients)
    await dead.budgets.reserve(Caller("t1"), W)  # never settled nor released
    with pytest.raises(BudgetExceeded):
        await alive.budgets.reserve(Caller("t1"), W)
    await asyncio.sleep(0.4)
    await alive.budgets.reserve(Caller("t1"), W)


async def test_reconcile_rebuilds_from_db_counting_unflushed_settlements_once(
        postgres_url: str, redis_prefix: str, clients: list[Redis], tmp_path) -> None:  # type: ignore[no-untyped-def]
    sf = migrated_db(postgres_url)
    with sf.begin() as s:
        put_policy(s, scope="tenant", tenant_id="t1", limit_usd=usd(100 * W))
    rt = runtime(sf, clients[0], redis_prefix)
    guarded = rt.budgets.counters
    assert isinstance(guarded, GuardedCounters)
    counters = guarded.redis
    assert isinstance(counters, RedisCounters)
    ledger = Ledger(sf, tmp_path / "journal")
    ledger.start()
    caller = Caller("t1", "k1")

    def entry(rid: str) -> LedgerEntry:
        return LedgerEntry(new_entry_id(), rid, "t1", "k1", "direct", "low", "m", Usage(10, 100), W, W)

    for i in range(3):  # settled and flushed
        res = await rt.budgets.reserve(caller, W, request_id=f"r{i}")
        await res.settle(W)
        ledger.record(entry(f"r{i}"))
    assert await ledger.aflush()
    res = await rt.budgets.reserve(caller, W, request_id="r-late")
    await res.settle(W)  # settled; its ledger row is not written yet
    await clients[0].hset(f"{redis_prefix}budget:{res.counters[0].key}", "spent", 0)  # corrupt the counter
    assert await counters.reconcile() == 1
    assert (await rt.budgets.status(caller)).spent_nanos == 4 * W
    ledger.record(entry("r-late"))
    assert await ledger.aflush()
    await counters.reconcile()
    assert (await rt.budgets.status(caller)).spent_nanos == 4 * W  # not 5
    await clients[0].delete(f"{redis_prefix}budget:{res.counters[0].key}")  # Redis lost the key
    assert (await rt.budgets.status(caller)).spent_nanos == 4 * W
    await ledger.astop()


async def test_redis_counters_roll_over_at_utc_month_boundary(postgres_url: str, redis_prefix: str,
                                                             clients: list[Redis]) -> None:
    sf = migrated_db(postgres_url)
    with sf.begin() as s:
        put_policy(s, scope="tenant", tenant_id="t1", period="month", limit_usd=usd(W * 3 // 2))
    clock = FakeClock(datetime(2026, 11, 30, 23, 59, 59, tzinfo=UTC))
    rt = runtime(sf, clients[0], redis_prefix, clock=clock)
    await (await rt.budgets.reserve(Caller("t1"), W)).settle(W)
    with pytest.raises(BudgetExceeded):
        await rt.budgets.reserve(Caller("t1"), W)
    clock.advance(seconds=1)
    await rt.budgets.reserve(Caller("t1"), W)
    assert (await rt.budgets.status(Caller("t1"))).period_key == "month:2026-12"


async def test_background_reconciler_repairs_a_drifted_counter(postgres_url: str, redis_prefix: str,
                                                               clients: list[Redis], tmp_path) -> None:  # type: ignore[no-untyped-def]
    sf = migrated_db(postgres_url)
    with sf.begin() as s:
        put_policy(s, scope="tenant", tenant_id="t1", limit_usd=usd(100 * W))
    ledger = Ledger(sf, tmp_path / "journal")
    ledger.start()
    rt = build_budget_runtime(SETTINGS, sf, redis_client=clients[0], redis_prefix=redis_prefix,
                              reconcile_interval_s=0.2)
    await rt.start()
    res = await rt.budgets.reserve(Caller("t1"), W, request_id="r1")
    ledger.record(LedgerEntry(new_entry_id(), "r1", "t1", None, "direct", "low", "m", Usage(10, 100), W, W))
    await res.settle(W)
    assert await ledger.aflush()
    key = f"{redis_prefix}budget:{res.counters[0].key}"
    await clients[0].hset(key, "spent", 123)  # drift (e.g. a lost write or a manual edit)
    for _ in range(50):
        await asyncio.sleep(0.1)
        if int(await clients[0].hget(key, "spent")) == W:
            break
    assert int(await clients[0].hget(key, "spent")) == W
    await rt.stop()
    await ledger.astop()
