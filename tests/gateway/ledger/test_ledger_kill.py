"""kill -9 at the ledger level: a child process records entries with ``record_durable`` from
concurrent tasks and prints "ready <id> <tokens>" after each is acknowledged; it is SIGKILLed
mid-stream. Run at both acknowledging levels: ``process`` (acknowledged once written with
write(2), fdatasync later in the background — the chat path's default, and exactly the kill -9
guarantee) and ``fsync`` (acknowledged after the fdatasync). A new Ledger on the same journal and database must hold every acknowledged entry,
possibly a few in-flight ones, never a duplicate, with daily_spend equal to the row sums."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.db import migrate
from gateway.db.session import make_engine, make_session_factory
from gateway.ledger import Ledger

pytestmark = pytest.mark.process

CHILD = textwrap.dedent("""
    import asyncio, sys
    from gateway.db.session import make_engine, make_session_factory
    from gateway.ledger import Ledger, LedgerEntry
    from gateway.providers.base import Usage

    url, journal, level = sys.argv[1], sys.argv[2], sys.argv[3]
    # A slow DB flush (200 ms, big batches) so the kill always finds journaled, uncommitted rows.
    ledger = Ledger(make_session_factory(make_engine(url)), journal, flush_interval_ms=200,
                    batch_size=100_000, max_segment_bytes=16384)
    ledger.start()

    async def worker(w):
        for i in range(100000):
            n = w * 1_000_000 + i
            e = LedgerEntry(id=f"e-{n}", request_id=f"r-{n}", tenant_id="t1", key_id="k1", stage="direct",
                            tier="low", model="demo-moe", usage=Usage(prompt_tokens=n % 97 + 1,
                            completion_tokens=n % 13 + 1), cost_nanos=1_000_000, baseline_cost_nanos=10_000_000)
            await ledger.record_durable(e, level)
            sys.stdout.write(f"ready {e.id} {e.usage.prompt_tokens} {e.usage.completion_tokens}\\n")
            sys.stdout.flush()

    async def main():
        await asyncio.gather(*(worker(w) for w in range(8)))

    asyncio.run(main())
""")


@pytest.mark.parametrize("level", ["process", "fsync"])
def test_kill_9_loses_no_acknowledged_entry_and_duplicates_none(tmp_path: Path, level: str) -> None:
    url = f"sqlite:///{tmp_path}/k.db"
    migrate.upgrade(url)
    journal = tmp_path / "journal"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    child = subprocess.Popen([sys.executable, str(script), url, str(journal), level], stdout=subprocess.PIPE,
                             env=env, text=True)
    acked: dict[str, tuple[int, int]] = {}
    assert child.stdout is not None

    def read_acks(lines: list[str]) -> None:
        for line in lines:
            parts = line.split()
            if len(parts) == 4 and line.endswith("\n"):  # a torn last line counts as in flight
                acked[parts[1]] = (int(parts[2]), int(parts[3]))

    try:
        for line in child.stdout:
            read_acks([line])
            if len(acked) >= 1500:
                break
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        read_acks(child.stdout.readlines())  # acknowledged before the kill, still in the pipe
    finally:
        child.kill()
        child.wait(10)
    assert child.returncode == -signal.SIGKILL
    assert len(acked) >= 1500

    engine = make_engine(url)
    factory = make_session_factory(engine)
    with factory() as s:
        before = s.scalar(sa.text("SELECT count(*) FROM ledger_entries"))
    ledger = Ledger(factory, journal)
    ledger.start()
    assert ledger.stop(timeout_s=30)
    with factory() as s:
        rows = {r[0]: (r[1], r[2]) for r in s.execute(sa.text(
            "SELECT id, prompt_tokens, completion_tokens FROM ledger_entries"))}
        daily = s.execute(sa.text(
            "SELECT sum(requests), sum(prompt_tokens), sum(completion_tokens) FROM daily_spend")).one()
    engine.dispose()

    assert before < len(rows), "the test must exercise replay: some acked rows only in the journal"
    assert set(acked) <= set(rows), "an acknowledged entry was lost"
    assert all(rows[i] == acked[i] for i in acked)
    in_flight = set(rows) - set(acked)
    assert len(in_flight) <= 8 + 1  # each worker has at most one entry between record and print
    assert tuple(daily) == (len(rows), sum(p for p, _ in rows.values()), sum(c for _, c in rows.values()))
    assert list(journal.rglob("*.jsonl")) == []
