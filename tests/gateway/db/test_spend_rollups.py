"""The admin overview's spend rollups (gateway.db.rollups, revision 0008_spend_rollups): the
spans that cover a window are aligned, disjoint and exactly the window; the ledger applier keeps
``tenant_spend_spans`` and ``daily_tier_spend`` equal to ``daily_spend`` and to the raw ledger
to the nano-dollar for every window (journal replays included); the migration backfills both from
an existing ``daily_spend``. SQLite always, PostgreSQL marked."""

from __future__ import annotations

import random
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from gateway.db import admin_queries as aq
from gateway.db import migrate
from gateway.db.models import DailySpend, DailyTierSpend, LedgerEntryRow, TenantSpendSpan
from gateway.db.rollups import EPOCH, SPANS, cover, span_start
from gateway.db.session import make_engine, make_session_factory
from gateway.ledger.applier import write_records
from gateway.ledger.entries import LedgerEntry, new_entry_id
from gateway.providers.base import Usage
from tests.gateway.budgets_support import migrated_db, sqlite_url

TODAY = datetime.now(UTC).date()


def test_cover_is_exactly_the_window_in_few_aligned_spans() -> None:
    rng = random.Random(7)
    for _ in range(500):
        since = TODAY - timedelta(days=rng.randrange(0, 2000))
        until = since + timedelta(days=rng.randrange(0, 800))
        spans = cover(since, until)
        days: list[date] = []
        for n, start in spans:
            assert n in SPANS and (start - EPOCH).days % n == 0 and span_start(start, n) == start
            days += [start + timedelta(days=i) for i in range(n)]
        assert days == [since + timedelta(days=i) for i in range((until - since).days + 1)]  # disjoint, in order
        length = (until - since).days + 1
        assert len(spans) <= 2 * len(SPANS) + length // SPANS[-1]
    assert cover(TODAY, TODAY - timedelta(days=1)) == []
    assert len(cover(TODAY - timedelta(days=29), TODAY)) <= 9  # the default 30-day window


def _entries(rng: random.Random, tenants: list[str], n: int) -> list[LedgerEntry]:
    out = []
    for i in range(n):
        at = datetime.combine(TODAY - timedelta(days=rng.randrange(0, 400)), datetime.min.time(), UTC) + timedelta(
            seconds=rng.randrange(0, 86400))
        out.append(LedgerEntry(new_entry_id(), f"req_{i}", rng.choice(tenants), None, "direct",
                               rng.choice(("low", "medium", "high")), rng.choice(("m-a", "m-b")),
                               Usage(prompt_tokens=rng.randrange(1, 500), completion_tokens=rng.randrange(1, 90)),
                               rng.randrange(0, 10**7), rng.randrange(0, 3 * 10**7), created_at=at))
    return out


def _ledger_days(s: Session) -> list[tuple[str, date, Decimal, Decimal]]:
    """The raw ledger: (tenant, UTC day, cost, baseline) per row, exact decimals."""
    return [(t, (at if at.tzinfo else at.replace(tzinfo=UTC)).astimezone(UTC).date(), Decimal(str(c)), Decimal(str(b)))
            for t, at, c, b in s.execute(sa.select(LedgerEntryRow.tenant_id, LedgerEntryRow.created_at,
                                                   LedgerEntryRow.cost_usd, LedgerEntryRow.baseline_cost_usd))]


def _ledger_by_tenant(ledger: list[tuple[str, date, Decimal, Decimal]], since: date,
                      until: date) -> dict[str, tuple[int, Decimal, Decimal]]:
    """Straight from the raw ledger, summed in Python."""
    out: dict[str, tuple[int, Decimal, Decimal]] = {}
    for tenant, day, cost, base in ledger:
        if since <= day <= until:
            n, c, b = out.get(tenant, (0, Decimal(0), Decimal(0)))
            out[tenant] = (n + 1, c + cost, b + base)
    return out


def _check_rollups(sf: sessionmaker[Session]) -> None:
    rng = random.Random(11)
    tenants = [f"ten_{i}" for i in range(7)]
    entries = _entries(rng, tenants, 300)
    for i in range(0, len(entries), 50):
        with sf.begin() as s:
            write_records(s, entries[i:i + 50])
    with sf.begin() as s:  # a journal segment replayed: nothing is counted twice
        write_records(s, entries[100:180])
    with sf() as s:
        ledger = _ledger_days(s)
        assert len(ledger) == len(entries)
        for since, until in [(TODAY - timedelta(days=29), TODAY), (TODAY - timedelta(days=365), TODAY),
                             (TODAY, TODAY)] + [
                (TODAY - timedelta(days=a), TODAY - timedelta(days=a) + timedelta(days=b))
                for a, b in ((rng.randrange(0, 420), rng.randrange(0, 400)) for _ in range(25))]:
            raw = _ledger_by_tenant(ledger, since, until)
            got = {t.tenant_id: t.totals for t in aq.spend_by_tenant(s, since, until) if t.totals.calls}
            assert {k: (v.calls, v.cost_usd, v.baseline_cost_usd) for k, v in got.items()} == raw, (since, until)
            day_tier = aq.spend_by_day_tier(s, since, until)
            _per_day, total = aq.days_and_total(day_tier)
            assert total.cost_usd == sum((c for _, c, _ in raw.values()), Decimal(0))
            assert total.calls == sum(n for n, _, _ in raw.values())
            direct = s.execute(sa.select(DailySpend.day, DailySpend.tier, sa.func.count()).where(
                DailySpend.day >= since, DailySpend.day <= until).group_by(DailySpend.day, DailySpend.tier)).all()
            assert {(d, t) for d, t, _ in direct} == {(d, t) for d, tiers in day_tier.items() for t in tiers}
        # every span row equals the daily_spend rows it covers (exact decimals, summed in Python)
        daily = list(s.scalars(sa.select(DailySpend)))
        by_tenant_day: dict[tuple[str, date], list[DailySpend]] = {}
        for d in daily:
            by_tenant_day.setdefault((d.tenant_id, d.day), []).append(d)
        for row in s.scalars(sa.select(TenantSpendSpan)):
            inside = [d for i in range(row.span_days)
                      for d in by_tenant_day.get((row.tenant_id, row.start_day + timedelta(days=i)), [])]
            assert row.requests == sum(d.requests for d in inside)
            assert Decimal(str(row.cost_usd)) == sum((Decimal(str(d.cost_usd)) for d in inside), Decimal(0))
        assert s.scalar(sa.select(sa.func.count()).select_from(DailyTierSpend)) == len({(d.day, d.tier) for d in daily})


def test_rollups_equal_the_ledger_sqlite(tmp_path: Path) -> None:
    _check_rollups(migrated_db(sqlite_url(tmp_path)))


@pytest.mark.postgres
def test_rollups_equal_the_ledger_postgres(postgres_url: str) -> None:
    _check_rollups(migrated_db(postgres_url))


def _backfill(url: str) -> None:
    migrate.upgrade(url, "0007_ledger_intents")
    engine = make_engine(url)
    rows: list[dict[str, Any]] = [{"tenant_id": f"t{i % 3}", "day": TODAY - timedelta(days=i % 40), "model": f"m{i}",
             "tier": ("low", "high")[i % 2], "requests": i + 1, "prompt_tokens": 10 * i, "cached_tokens": 0,
             "completion_tokens": i, "reasoning_tokens": 0, "cost_usd": Decimal(i) / 10**9 + Decimal("0.1"),
             "baseline_cost_usd": Decimal(3 * i) / 10**9} for i in range(6000)]  # > one streamed chunk
    with engine.begin() as conn:
        conn.execute(sa.insert(DailySpend), rows)
    engine.dispose()
    migrate.upgrade(url)
    sf = make_session_factory(make_engine(url))
    with sf() as s:
        for since in (TODAY - timedelta(days=39), TODAY - timedelta(days=6), TODAY):
            got = {t.tenant_id: t.totals.cost_usd for t in aq.spend_by_tenant(s, since, TODAY)}
            want: dict[str, Decimal] = {}
            for r in rows:
                if r["day"] >= since:
                    want[r["tenant_id"]] = want.get(r["tenant_id"], Decimal(0)) + r["cost_usd"]
            assert got == want
            _, total = aq.days_and_total(aq.spend_by_day_tier(s, since, TODAY))
            assert total.cost_usd == sum(want.values(), Decimal(0))
    migrate.downgrade(url, "0007_ledger_intents")
    assert not {"tenant_spend_spans", "daily_tier_spend"} & set(sa.inspect(make_engine(url)).get_table_names())


def test_migration_backfills_the_rollups_sqlite(tmp_path: Path) -> None:
    _backfill(sqlite_url(tmp_path))


@pytest.mark.postgres
def test_migration_backfills_the_rollups_postgres(postgres_url: str) -> None:
    _backfill(postgres_url)


@pytest.mark.postgres
def test_concurrent_appliers_keep_the_rollups_exact_postgres(postgres_url: str) -> None:
    """Four writers (as four replicas' ledger syncers) apply batches that hit the same tenants,
    days and tiers at once — the same span and ``daily_tier_spend`` rows: none fails (one lock
    order, so no deadlock) and the rollups still equal the raw ledger exactly."""
    import threading

    sf = migrated_db(postgres_url)
    rng = random.Random(5)
    entries = _entries(rng, ["ten_a", "ten_b"], 400)
    for i, e in enumerate(entries):  # crowd them onto 3 days so the writers collide
        day = TODAY - timedelta(days=i % 3)
        entries[i] = LedgerEntry(e.id, e.request_id, e.tenant_id, None, e.stage, e.tier, e.model, e.usage,
                                 e.cost_nanos, e.baseline_cost_nanos,
                                 created_at=datetime.combine(day, datetime.min.time(), UTC) + timedelta(seconds=i))
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def writer(part: list[LedgerEntry]) -> None:
        try:
            start.wait()
            for j in range(0, len(part), 10):
                with sf.begin() as s:
                    write_records(s, list(reversed(part[j:j + 10])) if j % 20 else part[j:j + 10])
        except BaseException as err:  # collected: the test fails on it below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(entries[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    with sf() as s:
        ledger = _ledger_days(s)
        assert len(ledger) == len(entries)
        since = TODAY - timedelta(days=2)
        raw = _ledger_by_tenant(ledger, since, TODAY)
        got = {t.tenant_id: (t.totals.calls, t.totals.cost_usd, t.totals.baseline_cost_usd)
               for t in aq.spend_by_tenant(s, since, TODAY) if t.totals.calls}
        assert got == raw
        _, total = aq.days_and_total(aq.spend_by_day_tier(s, since, TODAY))
        assert total.cost_usd == sum((c for _, c, _ in raw.values()), Decimal(0)) and total.calls == len(entries)
