"""Budgets with the embedded backend (in-process counters + SQLite): atomic reservations,
restart from the ledger truth, orphaned reservations expiring after their lease, UTC
period rollover, soft limits, key budgets; calls made the way the request path makes them
(``Budgets.reserve`` → ``Hold.settle`` / ``Hold.release``). Money is integer nano-USD, so
spend is asserted exactly."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from sqlalchemy import select

from gateway.budgets import build_budget_runtime, put_policy
from gateway.db.models import BudgetReservationRow
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
    sqlite_url,
    usd,
)

SETTINGS = small_settings()


def set_budget(sf, **kw):  # type: ignore[no-untyped-def]
    with sf.begin() as s:
        put_policy(s, **kw)


async def test_64_concurrent_requests_against_budget_for_10(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))
    set_budget(sf, scope="tenant", tenant_id="t1", period="month", limit_usd=usd(W * 21 // 2))
    rt = build_budget_runtime(SETTINGS, sf, clock=FakeClock())
    await rt.start()
    caller = Caller("t1", "k1")
    outcomes: list[str] = []

    async def one() -> None:
        try:
            await budgeted_call(rt, caller, W, W, tokens=110, pause_s=random.random() / 100)
            outcomes.append("ok")
        except BudgetExceeded as exc:
            assert exc.status == 429 and exc.code == "budget_exceeded"
            outcomes.append("denied")

    await asyncio.gather(*(one() for _ in range(64)))
    assert outcomes.count("ok") == 10 and outcomes.count("denied") == 54
    status = await rt.budgets.status(caller)
    assert (status.spent_nanos, status.held_nanos) == (10 * W, 0)  # overshoot 0 (≤ one hold)
    for _ in range(5):  # denied stays denied
        with pytest.raises(BudgetExceeded):
            await rt.budgets.reserve(caller, W)
    await rt.stop()
    with sf() as s:
        statuses = [r.status for r in s.scalars(select(BudgetReservationRow))]
    assert sorted(statuses) == ["settled"] * 10


async def test_cheaper_actuals_free_budget_but_never_overshoot(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))
    set_budget(sf, scope="tenant", tenant_id="t1", limit_usd=usd(W * 21 // 2))
    rt = build_budget_runtime(SETTINGS, sf, clock=FakeClock())
    await rt.start()
    caller = Caller("t1")
    ok = 0

    async def one() -> None:
        nonlocal ok
        try:
            await budgeted_call(rt, caller, W, W // 4, pause_s=random.random() / 200)
            ok += 1
        except BudgetExceeded:
            pass

    for _ in range(4):
        await asyncio.gather(*(one() for _ in range(16)))
    status = await rt.budgets.status(caller)
    assert ok > 10 and status.spent_nanos == ok * (W // 4) <= W * 21 // 2
    await rt.stop()


async def test_failure_and_cancellation_release_the_hold(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))
    set_budget(sf, scope="tenant", tenant_id="t1", limit_usd=usd(W * 3 // 2))
    rt = build_budget_runtime(SETTINGS, sf, clock=FakeClock())
    await rt.start()
    caller = Caller("t1")
    hold = await rt.budgets.reserve(caller, W)  # the upstream call failed: nothing to charge
    assert await hold.settle(0) is None and hold.settled_nanos == 0
    task = asyncio.create_task(budgeted_call(rt, caller, W, W, pause_s=60))
    while (await rt.budgets.status(caller)).held_nanos == 0:
        await asyncio.sleep(0.001)
    assert (await rt.budgets.status(caller)).held_nanos == W
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    status = await rt.budgets.status(caller)
    assert status.held_nanos == 0 and status.spent_nanos == 0
    await rt.stop()
    with sf() as s:
        assert sorted(r.status for r in s.scalars(select(BudgetReservationRow))) == ["released", "released"]


async def test_restart_continues_from_ledger_daily_spend(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))
    clock = FakeClock()
    set_budget(sf, scope="tenant", tenant_id="t1", limit_usd=usd(5 * W))
    ledger = Ledger(sf, tmp_path / "journal")
    ledger.start()
    for _ in range(3):
        ledger.record(LedgerEntry(new_entry_id(), "req", "t1", "k1", "direct", "low", "m",
                                  Usage(10, 100), W, W, created_at=clock()))
    assert await ledger.aflush()
    rt = build_budget_runtime(SETTINGS, sf, clock=clock)  # a "restarted" process
    await rt.start()
    status = await rt.budgets.status(Caller("t1", "k1"))
    assert status.spent_nanos == 3 * W
    await rt.budgets.reserve(Caller("t1"), W)
    with pytest.raises(BudgetExceeded):
        await rt.budgets.reserve(Caller("t1"), W * 3 // 2)
    await rt.stop()
    await ledger.astop()


async def test_dead_process_holds_expire_after_lease(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))
    clock = FakeClock()
    set_budget(sf, scope="tenant", tenant_id="t1", limit_usd=usd(W * 5 // 2))
    settings = small_settings(reservation_lease_s=30)
    dead = build_budget_runtime(settings, sf, clock=clock)
    await dead.start()
    await dead.budgets.reserve(Caller("t1"), W)
    await dead.budgets.reserve(Caller("t1"), W)  # the process "dies" holding both
    clock.advance(seconds=5)
    alive = build_budget_runtime(settings, sf, clock=clock)
    await alive.start()
    with pytest.raises(BudgetExceeded):  # the orphaned holds still count within the lease
        await alive.budgets.reserve(Caller("t1"), W)
    clock.advance(seconds=26)
    res = await alive.budgets.reserve(Caller("t1"), W)
    assert res.remaining_nanos == W * 3 // 2
    await alive.stop()
    with sf() as s:
        assert sorted(r.status for r in s.scalars(select(BudgetReservationRow))) == ["expired", "expired", "held"]


async def test_budget_resets_at_utc_period_boundary(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))
    from datetime import UTC, datetime
    clock = FakeClock(datetime(2026, 11, 30, 23, 59, 50, tzinfo=UTC))
    set_budget(sf, scope="tenant", tenant_id="t1", period="day", limit_usd=usd(W * 3 // 2))
    rt = build_budget_runtime(SETTINGS, sf, clock=clock)
    await rt.start()
    res = await rt.budgets.reserve(Caller("t1"), W)
    await res.settle(W)
    with pytest.raises(BudgetExceeded):
        await rt.budgets.reserve(Caller("t1"), W)
    clock.advance(seconds=10)  # 00:00:00 UTC: a new day, no cron involved
    status = await rt.budgets.status(Caller("t1"))
    assert status.period_key == "day:2026-12-01" and status.spent_nanos == 0
    await rt.budgets.reserve(Caller("t1"), W)
    await rt.stop()


async def test_key_budget_soft_limit_and_headers(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))
    set_budget(sf, scope="tenant", tenant_id="t1", limit_usd=usd(100 * W))
    set_budget(sf, scope="key", tenant_id="t1", key_id="k1", period="total", limit_usd=usd(4 * W),
               soft_limit_usd=usd(2 * W))
    rt = build_budget_runtime(SETTINGS, sf, clock=FakeClock())
    await rt.start()
    k1, k2 = Caller("t1", "k1"), Caller("t1", "k2")
    for _ in range(2):
        settled = await budgeted_call(rt, k1, W, W)
    status = await rt.budgets.status(k1)
    assert status.soft_exceeded and status.subject == "key:k1"
    assert settled is not None and settled.headers() == {"x-tiergate-budget-remaining-usd": "0.000420000"}
    assert not (await rt.budgets.status(k2)).soft_exceeded  # the tenant is far from its limits
    for _ in range(2):
        await budgeted_call(rt, k1, W, W)
    with pytest.raises(BudgetExceeded) as err:
        await rt.budgets.reserve(k1, W)
    assert err.value.headers["x-tiergate-budget-remaining-usd"] == "0.000000000"
    await rt.budgets.reserve(k2, W)  # another key of the same tenant is unaffected
    await rt.stop()


async def test_no_limit_means_no_counters(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))
    rt = build_budget_runtime(SETTINGS, sf, clock=FakeClock())
    await rt.start()
    res = await rt.budgets.reserve(Caller("t9"), 1000 * 10**9)
    assert res.counters == () and (await rt.budgets.status(Caller("t9"))).remaining_nanos is None
    await rt.stop()
