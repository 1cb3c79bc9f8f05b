"""gateway.db.admin_queries on real databases: rows written by the real Ledger, sums equal to
the seeded costs, tier mix bounded by its window, keyset paging over equal timestamps, and the
request reads planned on the (tenant_id, created_at) index. SQLite always, PostgreSQL marked."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from gateway.db import admin_queries as aq
from gateway.db.queries import create_tenant
from gateway.ledger import Ledger
from gateway.ledger.entries import LedgerEntry, RequestRecord, new_entry_id
from gateway.money import usd_to_nanos
from gateway.providers.base import Usage
from tests.gateway.budgets_support import migrated_db, sqlite_url

NOW = datetime.now(UTC).replace(microsecond=0)


def _fill(sf: sessionmaker[Session], journal: Path) -> tuple[str, str, list[RequestRecord], Decimal, Decimal]:
    with sf() as s, s.begin():
        a, b = create_tenant(s, "alpha").id, create_tenant(s, "beta").id
    ledger = Ledger(sf, journal, flush_interval_ms=5)
    ledger.start()
    recs: list[RequestRecord] = []
    cost = base = Decimal(0)
    try:
        for i in range(9):
            tenant = a if i < 6 else b
            at = NOW - timedelta(hours=i // 2)  # pairs share a timestamp: paging must break ties by id
            c, bl = Decimal(i + 1) / 1000, Decimal(4 * (i + 1)) / 1000
            tier = ("low", "medium", "high")[i % 3]
            ledger.record(LedgerEntry(new_entry_id(), f"req_{i}", tenant, None, "direct", tier, "m",
                                      Usage(prompt_tokens=7, completion_tokens=3), usd_to_nanos(c), usd_to_nanos(bl),
                                      created_at=at))
            rec = RequestRecord(f"req_{i}", tenant, None, "auto", "ok", tier=tier, pipeline=tier == "high",
                                cost_nanos=usd_to_nanos(c), baseline_cost_nanos=usd_to_nanos(bl), created_at=at)
            ledger.record_request(rec)
            recs.append(rec)
            cost, base = cost + c, base + bl
        assert ledger.flush(10)
    finally:
        ledger.stop()
    return a, b, recs, cost, base


def _check(sf: sessionmaker[Session], journal: Path) -> None:
    a, b, recs, cost, base = _fill(sf, journal)
    today = NOW.date()
    with sf() as s:
        total = aq.spend_total(s, today - timedelta(days=1), today)
        assert (total.cost_usd, total.baseline_cost_usd, total.calls) == (cost, base, 9)
        assert total.savings_usd == base - cost and total.savings_ratio == pytest.approx(0.75)
        per_tenant = {t.name: t.totals for t in aq.spend_by_tenant(s, today - timedelta(days=1), today)}
        assert per_tenant["alpha"].cost_usd == sum(Decimal(i + 1) / 1000 for i in range(6))
        assert per_tenant["beta"].calls == 3
        assert sum(d.totals.cost_usd for d in aq.spend_by_day(s, today - timedelta(days=1), today)) == cost
        assert aq.spend_total(s, today + timedelta(days=1), today + timedelta(days=2)).calls == 0
        assert set(aq.spend_by_tier(s, today - timedelta(days=1), today, a)) == {"low", "medium", "high"}
        # The overview's one-scan form (GROUPING SETS on PostgreSQL) equals the two plain queries.
        window = (today - timedelta(days=1), today)
        tenants, day_tier = aq.overview_spend(s, *window)
        assert tenants == aq.spend_by_tenant(s, *window) and day_tier == aq.spend_by_day_tier(s, *window)
        per_day, total2 = aq.days_and_total(day_tier)
        assert per_day == aq.spend_by_day(s, *window) and total2 == total
        mixes = aq.tier_mix_by_tenant(s, [a, b, "nobody"], NOW - timedelta(hours=10))
        assert mixes == {a: aq.tier_mix(s, a, NOW - timedelta(hours=10)), b: aq.tier_mix(s, b, NOW - timedelta(hours=10)),
                         "nobody": aq.TierMix(0, {}, 0, 0)}

        mix = aq.tier_mix(s, a, NOW - timedelta(hours=10))
        assert (mix.total, mix.by_tier, mix.pipeline) == (6, {"low": 2, "medium": 2, "high": 2}, 2)
        assert aq.tier_mix(s, a, NOW - timedelta(minutes=30)).total == 2  # only the newest pair
        assert aq.tier_mix(s, b, NOW - timedelta(hours=10)).total == 3
        assert aq.tier_mix(s, "nobody", NOW - timedelta(days=1)).pipeline_share is None

        seen: list[str] = []
        cursor = None
        while True:
            page = aq.recent_requests(s, a, limit=4, before=cursor)
            seen += [r.id for r in page.rows]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        expected = sorted((r for r in recs if r.tenant_id == a), key=lambda r: (r.created_at, r.id), reverse=True)
        assert seen == [r.id for r in expected]


def test_admin_queries_sqlite(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))
    _check(sf, tmp_path / "journal")
    issued: list[tuple[str, object]] = []
    engine = sf.kw["bind"]

    def capture(conn: object, cursor: object, statement: str, params: object, *_: object) -> None:
        issued.append((statement, params))

    sa.event.listen(engine, "before_cursor_execute", capture)
    with sf() as s:
        aq.tier_mix(s, "x", NOW)
        aq.recent_requests(s, "x", limit=5, before=(NOW, "req_1"))
    sa.event.remove(engine, "before_cursor_execute", capture)
    assert len(issued) == 2
    with engine.connect() as conn:  # the statements the helpers really issue are index range scans
        for statement, params in issued:
            plan = " ".join(str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params))
            assert "USING INDEX ix_requests_tenant_created" in plan, plan
            assert "tenant_id=? AND created_at" in plan, plan  # a range, not every row of the tenant


@pytest.mark.postgres
def test_admin_queries_postgres(tmp_path: Path, postgres_url: str) -> None:
    _check(migrated_db(postgres_url), tmp_path / "journal")
