"""Journals written before money became integer nano-USD (float ``cost_usd`` /
``baseline_cost_usd`` fields) still replay: their records are converted exactly as the old
writer stored them, next to new-format lines in the same segment, and a line with no money
field at all is refused as corrupt rather than billed at zero."""

from __future__ import annotations

import zlib
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy as sa

from gateway.db.models import Base
from gateway.db.session import make_engine, make_session_factory
from gateway.ledger import Ledger, LedgerEntry, RequestRecord
from gateway.ledger.journal import decode_line, encode_line, read_segment
from gateway.money import legacy_usd_to_nanos
from gateway.providers.base import Usage

AT = "2026-03-01T12:00:00+00:00"


def old_entry(i: int, cost: float, baseline: float) -> dict[str, Any]:
    """A ledger-entry line as the float-money format wrote it."""
    return {"t": "e", "id": f"old-{i}", "request_id": "req-old", "tenant_id": "t1", "key_id": "k1",
            "stage": "direct", "tier": "low", "model": "demo-moe", "prompt_tokens": 10, "cached_tokens": 0,
            "completion_tokens": 5, "reasoning_tokens": 0, "cost_usd": cost, "baseline_cost_usd": baseline,
            "status": "ok", "created_at": AT}


def old_request(cost: float, baseline: float) -> dict[str, Any]:
    return {"t": "r", "id": "req-old", "tenant_id": "t1", "key_id": "k1", "requested_model": "auto",
            "status": "ok", "tier": "low", "effort_source": "classifier", "classifier_score": 0.25,
            "classifier_version": "v1", "pipeline": False, "http_status": 200, "error_code": None,
            "latency_ms": 12.5, "prompt_tokens": 20, "completion_tokens": 10, "cost_usd": cost,
            "baseline_cost_usd": baseline, "created_at": AT}


def line(record: dict[str, Any]) -> bytes:
    payload = orjson.dumps(record)
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def test_old_lines_decode_to_nanos() -> None:
    entry = decode_line(line(old_entry(1, 0.000123456789, 0.1 + 0.2)))
    assert isinstance(entry, LedgerEntry)
    assert (entry.cost_nanos, entry.baseline_cost_nanos) == (123_457, 300_000_000)
    request = decode_line(line(old_request(0.00025, 0.001)))
    assert isinstance(request, RequestRecord)
    assert (request.cost_nanos, request.baseline_cost_nanos) == (250_000, 1_000_000)
    assert (request.latency_ms, request.classifier_version) == (12.5, "v1")


def test_new_lines_round_trip_and_a_line_without_money_is_corrupt() -> None:
    entry = LedgerEntry("new-1", "req", "t1", None, "plan", "high", "big", Usage(1, 2), 7, 9)
    assert decode_line(encode_line(entry)) == entry
    broken = old_entry(2, 0.1, 0.2)
    del broken["cost_usd"]
    assert decode_line(line(broken)) is None
    fractional = {**old_entry(3, 0.1, 0.2), "cost_nanos": 1.5}
    del fractional["cost_usd"]
    assert decode_line(line(fractional)) is None  # nano-USD are integers


def test_an_old_format_journal_replays_into_the_database(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    journal.mkdir()
    old = [old_entry(i, 0.000123456789 * (i + 1), 0.001) for i in range(3)]
    new = LedgerEntry("new-1", "req-new", "t1", "k1", "direct", "low", "demo-moe", Usage(10, 5), 42, 4_200)
    segment = journal / "000000000001.jsonl"
    segment.write_bytes(b"".join(line(r) for r in old) + line(old_request(0.00025, 0.003)) + encode_line(new))
    assert len(read_segment(segment).records) == 5 and read_segment(segment).skipped_lines == 0

    engine = make_engine(f"sqlite:///{tmp_path}/l.db")
    Base.metadata.create_all(engine)
    sf = make_session_factory(engine)
    ledger = Ledger(sf, journal)
    ledger.start()
    assert ledger.flush(10) and ledger.stop()
    with sf() as s:
        costs = dict(s.execute(sa.text("SELECT id, cost_usd FROM ledger_entries")).all())
        daily = s.execute(sa.text("SELECT sum(cost_usd), sum(requests) FROM daily_spend")).one()
        request = s.execute(sa.text("SELECT cost_usd, baseline_cost_usd FROM requests")).one()
    engine.dispose()
    expected = {f"old-{i}": Decimal(str(0.000123456789 * (i + 1))).quantize(Decimal("1e-9")) for i in range(3)}
    assert {k: Decimal(str(v)) for k, v in costs.items()} == {**expected, "new-1": Decimal("0.000000042")}
    assert Decimal(str(daily[0])) == sum(expected.values()) + Decimal("0.000000042") and daily[1] == 4
    assert tuple(Decimal(str(v)) for v in request) == (Decimal("0.00025"), Decimal("0.003"))
    assert list(journal.rglob("*.jsonl")) == []  # replayed, committed, deleted


def test_new_entry_lines_still_carry_what_the_older_version_reads() -> None:
    """A rollback to the float-money version replays this version's ledger-entry lines: their
    ``cost_usd`` fields give back the same nano-USD the old writer would store; this version
    reads the integers and ignores the floats."""
    for nanos in (0, 1, 123_457, 999_999_999, 4_200_000_000_001, 10**15 - 1):
        entry = LedgerEntry("e", "req", "t1", None, "direct", "low", "m", Usage(1, 1), nanos, nanos + 7)
        d = entry.to_json()
        assert legacy_usd_to_nanos(d["cost_usd"]) == nanos and legacy_usd_to_nanos(d["baseline_cost_usd"]) == nanos + 7
        skewed = {**d, "cost_usd": 123.0}
        assert isinstance(decoded := decode_line(line(skewed)), LedgerEntry) and decoded.cost_nanos == nanos


def test_created_at_is_written_as_isoformat_writes_it() -> None:
    """Records hand ``created_at`` to the journal's encoder as the datetime itself; the line holds
    exactly the text ``datetime.isoformat()`` gives (what every earlier version wrote and reads
    back), with and without microseconds, in UTC, at another offset and without a zone (read back as
    UTC)."""
    from datetime import UTC, datetime, timedelta, timezone

    from gateway.ledger.entries import CallIntent

    moments = (datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC), datetime(2026, 3, 1, 12, 0, 0, 7, tzinfo=UTC),
               datetime(2026, 12, 31, 23, 59, 59, 999_999, tzinfo=timezone(timedelta(hours=5, minutes=30))),
               datetime(2026, 3, 1, 12, 0, 0, 120_000))
    for at in moments:
        records = (
            LedgerEntry("e", "req", "t1", None, "direct", "low", "m", Usage(1, 1), 5, 7, created_at=at),
            RequestRecord("req", "t1", None, "auto", "ok", created_at=at),
            CallIntent("c", "req", "t1", None, "direct", "low", "m", 1, 2, 1, {"input": 0.5}, 1, 1, 2, 2,
                       owner="o", created_at=at))
        for rec in records:
            written = encode_line(rec)
            assert written == line({**rec.to_json(), "created_at": at.isoformat()})
            decoded = decode_line(written.rstrip(b"\n"))
            assert decoded is not None and decoded.created_at == (at if at.tzinfo else at.replace(tzinfo=UTC))
