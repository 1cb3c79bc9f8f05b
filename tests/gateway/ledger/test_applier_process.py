"""The ledger's applier in a child process (gateway.ledger.applier_process), the default on
PostgreSQL: batches commit through it exactly once; a child that dies fails only the batch it had
(retried, through a new child); an error inside it reaches the parent's health with its type; it
exits when the process that started it dies; and it is refused on SQLite."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.db.models import Base
from gateway.db.session import make_engine, make_session_factory
from gateway.ledger import Ledger, LedgerEntry, new_entry_id
from gateway.providers.base import Usage

pytestmark = [pytest.mark.postgres, pytest.mark.process, pytest.mark.slow]


def entry(i: int) -> LedgerEntry:
    return LedgerEntry(id=new_entry_id(), request_id=f"req-{i}", tenant_id="t1", key_id="k1", stage="direct",
                       tier="low", model="demo-moe", usage=Usage(prompt_tokens=i, completion_tokens=2 * i),
                       cost_nanos=500_000_000, baseline_cost_nanos=1_000_000_000)


def _count(engine: sa.Engine, sql: str = "SELECT count(*) FROM ledger_entries") -> object:
    with engine.connect() as conn:
        return conn.scalar(sa.text(sql))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited


async def test_batches_commit_through_a_child_process_exactly_once(postgres_url: str, tmp_path: Path) -> None:
    engine = make_engine(postgres_url)
    Base.metadata.create_all(engine)
    ledger = Ledger(make_session_factory(engine), tmp_path / "j", flush_interval_ms=5)
    assert ledger.process_applier is not None
    ledger.start()
    await asyncio.gather(*(ledger.record_durable(entry(i), "process") for i in range(50)))
    assert await ledger.aflush()
    pid = ledger.process_applier.pid
    assert pid is not None and pid != os.getpid()
    # background work: nicer than the serving process by ledger.applier_nice (10)
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(os.getpriority(os.PRIO_PROCESS, 0) + 10, 19)

    os.kill(pid, signal.SIGKILL)  # the child dies: the next batch fails, is retried through a new child
    await asyncio.gather(*(ledger.record_durable(entry(100 + i), "process") for i in range(50)))
    assert await ledger.aflush()
    assert ledger.process_applier.started == 2 and ledger.process_applier.pid not in (None, pid)
    assert await ledger.astop()
    assert ledger.process_applier.pid is None  # stopped with the ledger
    assert _count(engine) == 100
    assert _count(engine, "SELECT sum(requests) FROM daily_spend") == 100
    assert _count(engine, "SELECT sum(prompt_tokens) FROM ledger_entries") == sum(range(50)) + sum(range(100, 150))
    engine.dispose()


async def test_an_error_in_the_child_reaches_health_and_the_batch_is_retried(postgres_url: str,
                                                                             tmp_path: Path) -> None:
    engine = make_engine(postgres_url)  # no tables yet: every batch fails in the child
    ledger = Ledger(make_session_factory(engine), tmp_path / "j", flush_interval_ms=5, retry_max_s=0.2)
    ledger.start()
    await ledger.record_durable(entry(1), "process")
    for _ in range(200):
        if ledger.health().consecutive_failures:
            break
        await asyncio.sleep(0.05)
    health = ledger.health()
    assert not health.ok and health.last_error is not None and "ProgrammingError" in health.last_error
    Base.metadata.create_all(engine)  # the database is fixed: the kept batch goes through
    assert await ledger.aflush(30)
    assert ledger.health().ok
    assert await ledger.astop()
    assert _count(engine) == 1
    engine.dispose()


def test_the_child_exits_when_its_parent_is_killed(postgres_url: str, tmp_path: Path) -> None:
    script = f"""
import asyncio, sys, time
from gateway.db.models import Base
from gateway.db.session import make_engine, make_session_factory
from gateway.ledger import Ledger, LedgerEntry, new_entry_id
from gateway.providers.base import Usage
engine = make_engine({postgres_url!r})
Base.metadata.create_all(engine)
ledger = Ledger(make_session_factory(engine), {str(tmp_path / 'j')!r}, flush_interval_ms=5)
ledger.start()
ledger.record(LedgerEntry(new_entry_id(), "r", "t1", None, "direct", "low", "m", Usage(1, 1), 1, 1))
assert ledger.flush(30)
print(ledger.process_applier.pid, flush=True)
time.sleep(60)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()  # kill -9: nothing runs in the parent to stop the child
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()
        parent.wait()


def test_the_process_applier_is_refused_on_sqlite(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/l.db")
    with pytest.raises(ValueError, match="PostgreSQL"):
        Ledger(make_session_factory(engine), tmp_path / "j", applier="process")
    assert Ledger(make_session_factory(engine), tmp_path / "j2").process_applier is None  # auto: a thread
    engine.dispose()


def test_a_batch_message_is_decoded_exactly_or_refused() -> None:
    """The child takes a batch as the journal lines the parent sends, or pickled records; a
    message whose record count does not match its lines, or of an unknown kind, is an error
    (answered to the parent, which retries the batch), never a batch written in part."""
    from gateway.ledger.applier_process import _LENGTH, _LINES, _PICKLED, _records
    from gateway.ledger.journal import encode_lines

    records = [entry(1), entry(2)]
    assert _records(_LINES + _LENGTH.pack(2) + encode_lines(records)) == records
    assert _records(_PICKLED + pickle.dumps(records)) == records
    with pytest.raises(ValueError, match="batch of 3"):
        _records(_LINES + _LENGTH.pack(3) + encode_lines(records))
    with pytest.raises(ValueError, match="unknown batch message"):
        _records(b"X" + encode_lines(records))
