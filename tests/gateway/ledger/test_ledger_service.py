"""Ledger service: non-blocking record, durable waits, journal segments deleted only after
commit, replay on start, DB outage kept in the journal and retried, health surfaced."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from gateway.db.models import Base
from gateway.db.session import make_engine, make_session_factory
from gateway.ledger import IN_PROGRESS, Ledger, LedgerEntry, LedgerError, RequestRecord, new_entry_id
from gateway.ledger.journal import Journal, read_segment
from gateway.providers.base import Usage


def entry(i: int) -> LedgerEntry:
    return LedgerEntry(id=new_entry_id(), request_id=f"req-{i}", tenant_id="t1", key_id="k1", stage="direct",
                       tier="low", model="demo-moe", usage=Usage(prompt_tokens=i, completion_tokens=2 * i),
                       cost_nanos=500_000_000, baseline_cost_nanos=1_000_000_000)


def _count(f: sessionmaker[Session], sql: str = "SELECT count(*) FROM ledger_entries") -> object:
    with f() as s:
        return s.scalar(sa.text(sql))


def _segments(d: Path) -> list[Path]:
    return sorted(d.rglob("*.jsonl"))


async def test_record_durable_then_committed_and_journal_emptied(db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    jdir = tmp_path / "j"
    ledger = Ledger(db, jdir, flush_interval_ms=5)
    ledger.start()
    await asyncio.gather(*(ledger.record_durable(entry(i)) for i in range(200)))
    assert ledger.health().records_durable >= 200
    assert await ledger.aflush(5)
    assert _count(db) == 200
    assert _count(db, "SELECT sum(prompt_tokens) FROM daily_spend") == sum(range(200))
    assert await ledger.astop()
    assert _segments(jdir) == []  # sealed and fully committed: deleted


def test_record_never_waits_for_the_database(db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With the DB thread stuck, record() still returns and the journal still fsyncs."""
    gate = threading.Event()
    real = db

    def slow_factory() -> Session:
        gate.wait(10)
        return real()

    ledger = Ledger(slow_factory, tmp_path / "j")  # type: ignore[arg-type]
    ledger.start()
    for i in range(100):
        ledger.record(entry(i))
    assert ledger.wait_durable_sync(5)
    assert sum(len(read_segment(p).records) for p in _segments(tmp_path / "j")) == 100
    assert _count(db) == 0
    gate.set()
    assert ledger.flush(5) and _count(db) == 100
    ledger.stop()


def test_db_outage_is_surfaced_retried_and_lossless(db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    dead_engine = make_engine(f"sqlite:///{tmp_path}/missing-tables.db")
    ledger = Ledger(make_session_factory(dead_engine), tmp_path / "j", flush_interval_ms=5, retry_max_s=0.05)
    ledger.start()
    for i in range(50):
        ledger.record(entry(i))
    assert ledger.wait_durable_sync(5)
    assert not ledger.flush(0.5)
    health = ledger.health()
    assert not health.ok and health.consecutive_failures >= 1 and "database" in (health.last_error or "")
    assert health.pending_db == 50
    assert not ledger.stop(timeout_s=0.3)  # cannot commit: entries stay in the journal
    dead_engine.dispose()
    assert sum(len(read_segment(p).records) for p in _segments(tmp_path / "j")) == 50

    recovered = Ledger(db, tmp_path / "j")
    recovered.start()
    assert recovered.flush(5)
    assert recovered.health().ok
    assert recovered.stop()
    assert _count(db) == 50
    assert _count(db, "SELECT sum(requests) FROM daily_spend") == 50
    assert _segments(tmp_path / "j") == []


def test_replay_of_already_committed_segment_is_idempotent(db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A crash after the DB commit but before the segment was deleted: replay must not double count."""
    entries = [entry(i) for i in range(30)]
    journal = Journal(tmp_path / "j")
    journal.existing_segments()
    journal.append(entries[:20])
    journal.seal()
    journal.append(entries[10:])  # overlap across segments too
    journal.seal()
    from gateway.ledger.applier import write_batch

    write_batch(db, entries[:25])  # the DB already holds most of them
    ledger = Ledger(db, tmp_path / "j")
    ledger.start()
    assert ledger.stop()
    assert _count(db) == 30
    assert _count(db, "SELECT sum(requests) FROM daily_spend") == 30
    assert _count(db, "SELECT sum(prompt_tokens) FROM daily_spend") == sum(range(30))
    assert _segments(tmp_path / "j") == []


def test_torn_tail_is_skipped_and_good_lines_replayed(db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    journal = Journal(tmp_path / "j")
    journal.existing_segments()
    journal.append([entry(1), entry(2)])
    journal.seal()
    seg = _segments(tmp_path / "j")[0]
    with seg.open("ab") as f:
        f.write(b'0badc0de {"t": "e", "id": "half-writ')  # crash mid-line
    assert read_segment(seg).skipped_lines == 1
    ledger = Ledger(db, tmp_path / "j")
    ledger.start()
    assert ledger.stop()
    assert _count(db) == 2


def test_corrupted_line_fails_its_checksum(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.existing_segments()
    journal.append([entry(7)])
    journal.seal()
    seg = _segments(tmp_path / "j")[0]
    seg.write_bytes(seg.read_bytes().replace(b'"prompt_tokens":7', b'"prompt_tokens":9'))
    contents = read_segment(seg)
    assert contents.records == [] and contents.skipped_lines == 1


def test_segments_rotate_and_new_run_continues_numbering(db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ledger = Ledger(db, tmp_path / "j", max_segment_bytes=1)  # rotate before every batch
    ledger.start()
    for i in range(5):
        ledger.record(entry(i))
        assert ledger.wait_durable_sync(5)
    assert ledger.stop()
    journal = Journal(tmp_path / "j")
    assert journal.existing_segments() == []
    assert _count(db) == 5


async def test_requests_share_the_durable_path(db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ledger = Ledger(db, tmp_path / "j")
    ledger.start()
    base = {"tenant_id": "t1", "key_id": "k1", "requested_model": "auto"}
    ledger.record_request(RequestRecord(id="chatcmpl-1", status=IN_PROGRESS, **base))
    ledger.record(entry(1))
    ledger.record_request(RequestRecord(id="chatcmpl-1", status="ok", http_status=200, **base))
    await ledger.wait_durable()
    assert await ledger.astop()
    assert _count(db, "SELECT status FROM requests WHERE id = 'chatcmpl-1'") == "ok"


def test_record_requires_a_running_ledger_and_the_right_type(db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ledger = Ledger(db, tmp_path / "j")
    with pytest.raises(LedgerError):
        ledger.record(entry(1))
    ledger.start()
    with pytest.raises(TypeError):
        ledger.record(RequestRecord(id="x", tenant_id="t", key_id=None, requested_model="m",  # type: ignore[arg-type]
                                    status="ok"))
    ledger.stop()
    with pytest.raises(LedgerError):
        ledger.record(entry(2))


@pytest.mark.parametrize("level", ["process", "fsync"])
async def test_journal_write_failure_fails_durable_waiters_and_retries(db, tmp_path: Path, level) -> None:  # type: ignore[no-untyped-def]
    ledger = Ledger(db, tmp_path / "j", retry_max_s=0.05)
    ledger.start()
    journal = ledger.writer.journal
    assert journal is not None
    real_write = journal.write_lines  # the writer's one write(2) per group
    calls = {"n": 0}

    def flaky_write(lines):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real_write(lines)

    journal.write_lines = flaky_write  # type: ignore[method-assign]
    with pytest.raises(LedgerError, match="No space left"):
        await ledger.record_durable(entry(1), level)
    assert await ledger.aflush(5)  # retried from memory, then committed
    assert _count(db) == 1
    assert ledger.health().ok
    assert await ledger.astop()


def test_two_ledgers_on_one_journal_root_never_touch_each_others_segments(db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Like two uvicorn workers: B starting must not adopt (replay and delete) A's live segment."""
    root = tmp_path / "j"
    slow = threading.Event()

    def stalled_factory() -> Session:
        slow.wait(10)
        return db()

    a = Ledger(stalled_factory, root)  # type: ignore[arg-type]
    a.start()
    for i in range(10):
        a.record(entry(i))
    assert a.wait_durable_sync(5)
    a_segments = _segments(root)
    assert len(a_segments) == 1
    b = Ledger(db, root)
    b.start()
    b.record(entry(100))
    assert b.stop()
    assert a_segments[0].exists()  # still A's, untouched
    assert _count(db) == 1
    slow.set()
    assert a.stop()
    assert _count(db) == 11
    assert _segments(root) == []
    assert [p.name for p in root.iterdir() if p.is_dir() and p.name != ".owners"] == []  # writer dirs removed when empty
    assert list((root / ".owners").iterdir()) == []  # both stopped with no call open: no owner left to settle


def test_segments_of_a_dead_writer_dir_are_adopted(db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    dead = tmp_path / "j" / "w-deadbeef"
    journal = Journal(dead)
    journal.existing_segments()
    journal.append([entry(1), entry(2)])
    journal.seal()
    journal.append([entry(3)])  # left open: its writer was killed
    (dead / ".lock").touch()
    ledger = Ledger(db, tmp_path / "j")
    ledger.start()
    assert ledger.stop()
    assert _count(db) == 3
    assert not dead.exists()


@pytest.mark.postgres
async def test_ledger_on_postgres_replays_without_double_counting(postgres_url: str, tmp_path: Path) -> None:
    from gateway.ledger.applier import write_batch

    engine = make_engine(postgres_url)
    Base.metadata.create_all(engine)
    factory = make_session_factory(engine)
    old = [entry(i) for i in range(40)]
    journal = Journal(tmp_path / "j")
    journal.existing_segments()
    journal.append(old)
    journal.seal()
    write_batch(factory, old[:30])  # committed before the "crash", segment not yet deleted
    ledger = Ledger(factory, tmp_path / "j", flush_interval_ms=5)
    ledger.start()
    await asyncio.gather(*(ledger.record_durable(entry(100 + i)) for i in range(60)))
    assert await ledger.astop()
    assert _count(factory) == 100
    expected_prompt = sum(range(40)) + sum(range(100, 160))
    assert _count(factory, "SELECT sum(prompt_tokens) FROM ledger_entries") == expected_prompt
    assert _count(factory, "SELECT sum(prompt_tokens) FROM daily_spend") == expected_prompt
    assert _count(factory, "SELECT sum(requests) FROM daily_spend") == 100
    assert _count(factory, "SELECT sum(cost_usd) FROM daily_spend") == 50  # 100 x 0.5, exact Numeric
    engine.dispose()
