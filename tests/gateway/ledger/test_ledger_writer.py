"""write_batch: idempotent inserts, daily_spend counted once, request upserts, hostile ids — on SQLite
and on PostgreSQL (the ``any_db`` fixture)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from gateway.db.models import Base
from gateway.db.session import make_engine, make_session_factory
from gateway.ledger import IN_PROGRESS, LedgerEntry, RequestRecord, new_entry_id
from gateway.ledger.applier import write_batch
from gateway.providers.base import Usage

DAY1 = datetime(2026, 3, 1, 23, 59, tzinfo=UTC)
DAY2 = datetime(2026, 3, 2, 0, 1, tzinfo=UTC)


def entry(i: int, *, tenant: str = "t1", tier: str = "low", created: datetime = DAY1,
          entry_id: str | None = None) -> LedgerEntry:
    return LedgerEntry(id=entry_id or new_entry_id(), request_id=f"req-{i}", tenant_id=tenant, key_id="k1",
                       stage="direct", tier=tier, model="demo-moe",
                       usage=Usage(prompt_tokens=100 + i, completion_tokens=10 + i, cached_tokens=i,
                                   reasoning_tokens=1),
                       cost_nanos=123_457, baseline_cost_nanos=1_000_000, created_at=created)


def _factory(url: str) -> tuple[sa.Engine, sessionmaker[Session]]:
    engine = make_engine(url)
    Base.metadata.create_all(engine)
    return engine, make_session_factory(engine)


@pytest.fixture
def factory(any_db: sessionmaker[Session]) -> sessionmaker[Session]:
    """SQLite, then PostgreSQL (its bulk statements, gateway.ledger.applier_pg)."""
    return any_db


def _sums(f: sessionmaker[Session], table: str) -> tuple:  # type: ignore[type-arg]
    count = "count(*)" if table == "ledger_entries" else "sum(requests)"
    with f() as s:
        return tuple(s.execute(sa.text(
            f"SELECT {count}, sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), "
            f"sum(reasoning_tokens), sum(cost_usd), sum(baseline_cost_usd) FROM {table}")).one())


def _check_idempotent(f: sessionmaker[Session]) -> None:
    batch = [entry(i, created=DAY1 if i % 2 else DAY2) for i in range(10)]
    first = write_batch(f, batch)
    assert (first.entries_inserted, first.entries_duplicate) == (10, 0)
    again = write_batch(f, [*batch, entry(99)])  # replay of the same ids plus one new
    assert (again.entries_inserted, again.entries_duplicate) == (1, 10)
    ledger, daily = _sums(f, "ledger_entries"), _sums(f, "daily_spend")
    assert ledger[:5] == daily[:5] == (11, sum(100 + i for i in [*range(10), 99]),
                                       sum([*range(10), 99]), sum(10 + i for i in [*range(10), 99]), 11)
    assert Decimal(str(ledger[5])) == Decimal(str(daily[5])) == Decimal("0.000123457") * 11
    with f() as s:
        days = s.execute(sa.text("SELECT day, requests FROM daily_spend ORDER BY day")).all()
    assert [(str(d), n) for d, n in days] == [("2026-03-01", 6), ("2026-03-02", 5)]


def test_replayed_batch_is_not_double_counted(factory) -> None:  # type: ignore[no-untyped-def]
    _check_idempotent(factory)


def test_duplicate_ids_within_one_batch_count_once(factory) -> None:  # type: ignore[no-untyped-def]
    e = entry(1)
    result = write_batch(factory, [e, e, e])
    assert result.entries_inserted == 1
    assert _sums(factory, "daily_spend")[0] == 1


def test_daily_spend_groups_by_tenant_model_tier(factory) -> None:  # type: ignore[no-untyped-def]
    write_batch(factory, [entry(0, tier="low"), entry(1, tier="high"), entry(2, tenant="t2"), entry(3)])
    with factory() as s:
        rows = s.execute(sa.text("SELECT tenant_id, tier, requests FROM daily_spend ORDER BY 1, 2")).all()
    assert [tuple(r) for r in rows] == [("t1", "high", 1), ("t1", "low", 2), ("t2", "low", 1)]


def test_request_upsert_final_status_wins(factory) -> None:  # type: ignore[no-untyped-def]
    base = {"tenant_id": "t1", "key_id": "k1", "requested_model": "auto"}
    write_batch(factory, [RequestRecord(id="r1", status=IN_PROGRESS, **base)])
    write_batch(factory, [RequestRecord(id="r1", status="ok", http_status=200, prompt_tokens=7, **base)])
    write_batch(factory, [RequestRecord(id="r1", status=IN_PROGRESS, **base)])  # late replay of the start
    write_batch(factory, [RequestRecord(id="r2", status="ok", **base),
                          RequestRecord(id="r2", status=IN_PROGRESS, **base)])
    with factory() as s:
        rows = s.execute(sa.text("SELECT id, status, http_status, prompt_tokens FROM requests ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [("r1", "ok", 200, 7), ("r2", "ok", None, 0)]


@pytest.mark.parametrize("evil", ["' OR '1'='1", "x'); DROP TABLE ledger_entries; --", "%(id)s", "?"])
def test_hostile_ids_are_plain_data(factory, evil: str) -> None:  # type: ignore[no-untyped-def]
    e = LedgerEntry(id=evil, request_id=evil, tenant_id=evil, key_id=evil, stage="direct", tier="low",
                    model=evil, usage=Usage(1, 1), cost_nanos=0, baseline_cost_nanos=0)
    write_batch(factory, [e, entry(1)])
    write_batch(factory, [e, RequestRecord(id=evil, tenant_id=evil, key_id=None, requested_model=evil,
                                           status="ok")])
    with factory() as s:
        assert s.scalar(sa.text("SELECT count(*) FROM ledger_entries")) == 2
        assert s.scalar(sa.text("SELECT tenant_id FROM ledger_entries WHERE id = :i"), {"i": evil}) == evil
        assert s.scalar(sa.text("SELECT count(*) FROM requests")) == 1


def test_failed_batch_writes_nothing(factory) -> None:  # type: ignore[no-untyped-def]
    """One bad row (NOT NULL violated) rolls back the whole batch, ledger and daily_spend alike."""
    bad = RequestRecord(id="r", tenant_id="t", key_id=None, requested_model=None, status="ok")  # type: ignore[arg-type]
    with pytest.raises(sa.exc.IntegrityError):
        write_batch(factory, [entry(1), bad])
    assert _sums(factory, "ledger_entries")[0] == 0
    assert _sums(factory, "daily_spend")[0] is None
