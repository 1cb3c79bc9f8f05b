"""Durability levels: a ``process`` waiter resumes once its group is written (before that group's
fdatasync), an ``fsync`` waiter only after the sync, ``none`` never waits; a failed sync fails
only the ``fsync`` waiters it covered; the chat path waits at ``ledger.durability``; the old
``durable_responses`` bool still configures it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from gateway.ledger import Ledger, LedgerEntry, LedgerError, new_entry_id
from gateway.ledger.journal import read_segment
from gateway.providers.base import Usage
from gateway.settings import LedgerSettings
from tests.gateway.gateway_harness import gateway
from tests.gateway.scripted_upstream import ScriptedUpstream

MSGS = [{"role": "user", "content": "hi"}]


def entry(i: int) -> LedgerEntry:
    return LedgerEntry(id=new_entry_id(), request_id=f"req-{i}", tenant_id="t1", key_id="k1", stage="direct",
                       tier="low", model="demo-moe", usage=Usage(prompt_tokens=i, completion_tokens=1),
                       cost_nanos=500_000_000, baseline_cost_nanos=1_000_000_000)


class GatedSync:
    """Replaces ``Journal.sync``: each call blocks until ``release`` and is counted."""

    def __init__(self, real: object) -> None:
        self.real = real
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        self.fail_next: OSError | None = None

    def __call__(self) -> None:
        self.entered.set()
        assert self.gate.wait(10), "test never released the sync"
        self.calls += 1
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        self.real()  # type: ignore[operator]


def gate_sync(ledger: Ledger) -> GatedSync:
    gated = GatedSync(ledger.writer.journal.sync)
    ledger.writer.journal.sync = gated  # type: ignore[method-assign]
    return gated


def journaled_ids(journal_dir: Path) -> set[str]:
    return {r.id for seg in journal_dir.rglob("*.jsonl") for r in read_segment(seg).records}


async def test_written_signal_precedes_the_fsync_and_fsync_level_waits_for_it(
        db: sessionmaker[Session], tmp_path: Path) -> None:
    ledger = Ledger(db, tmp_path / "j", flush_interval_ms=60_000, batch_size=100_000)
    ledger.start()
    sync = gate_sync(ledger)
    try:
        e = entry(1)
        await asyncio.wait_for(ledger.record_durable(e, "process"), 5)  # returns while the sync is blocked
        assert sync.calls == 0
        assert e.id in journaled_ids(tmp_path / "j")  # the bytes are in the segment file already
        health = ledger.health()
        assert health.records_written == 1 and health.records_durable == 0

        synced = asyncio.create_task(ledger.wait_durable("fsync"))
        assert await asyncio.to_thread(sync.entered.wait, 5)
        await asyncio.sleep(0.05)
        assert not synced.done(), "an fsync waiter resumed before the fdatasync finished"
        sync.gate.set()
        await asyncio.wait_for(synced, 5)
        assert sync.calls >= 1 and ledger.health().records_durable == 1
        await asyncio.wait_for(ledger.wait_durable("none"), 1)
    finally:
        sync.gate.set()
        assert await ledger.astop()


async def test_writes_continue_while_a_sync_is_in_progress(db: sessionmaker[Session], tmp_path: Path) -> None:
    ledger = Ledger(db, tmp_path / "j")
    ledger.start()
    sync = gate_sync(ledger)
    try:
        await ledger.record_durable(entry(1), "process")
        assert await asyncio.to_thread(sync.entered.wait, 5)  # the sync thread is now stuck in a sync
        later = [entry(i) for i in range(2, 12)]
        await asyncio.wait_for(asyncio.gather(*(ledger.record_durable(e, "process") for e in later)), 5)
        assert {e.id for e in later} <= journaled_ids(tmp_path / "j")
        assert sync.calls == 0
    finally:
        sync.gate.set()
    await ledger.wait_durable("fsync")
    assert await ledger.astop()


async def test_failed_sync_fails_fsync_waiters_only_and_is_surfaced(db: sessionmaker[Session],
                                                                    tmp_path: Path) -> None:
    ledger = Ledger(db, tmp_path / "j", retry_max_s=0.05)
    ledger.start()
    sync = gate_sync(ledger)
    sync.fail_next = OSError(5, "Input/output error")
    try:
        await asyncio.wait_for(ledger.record_durable(entry(1), "process"), 5)
        synced = asyncio.create_task(ledger.wait_durable("fsync"))
        await asyncio.sleep(0)  # the task registers its waiter before the sync is let through
        sync.gate.set()
        with pytest.raises(LedgerError, match="sync failed"):
            await asyncio.wait_for(synced, 5)
        # retried: a later fsync waiter succeeds and health recovers
        await asyncio.wait_for(ledger.record_durable(entry(2), "fsync"), 5)
        assert ledger.health().ok
        assert ledger.writer.journal.last_seq == 2  # the failed segment was sealed: entry 2 went to a new one
        assert await ledger.aflush(5)
    finally:
        sync.gate.set()
        assert await ledger.astop()


@pytest.mark.parametrize("durability", ["process", "fsync"])
async def test_chat_response_waits_for_sync_only_in_fsync_mode(tmp_path: Path, upstream: ScriptedUpstream,
                                                               durability: str) -> None:
    async with gateway(tmp_path, upstream, durability=durability) as gw:
        sync = gate_sync(gw.ledger)
        try:
            post = asyncio.create_task(gw.client.post("/v1/chat/completions", headers=gw.auth,
                                                      json={"model": "low", "messages": MSGS}))
            if durability == "process":
                r = await asyncio.wait_for(post, 5)  # answered with the sync still blocked
                assert sync.calls == 0
                assert r.headers["x-request-id"] in {rec.request_id for seg in (tmp_path / "journal").rglob(
                    "*.jsonl") for rec in read_segment(seg).records if isinstance(rec, LedgerEntry)}
            else:
                assert await asyncio.to_thread(sync.entered.wait, 5)
                await asyncio.sleep(0.1)
                assert not post.done(), "fsync mode answered before the journal's fdatasync"
                sync.gate.set()
                r = await asyncio.wait_for(post, 5)
                assert sync.calls >= 1
            assert r.status_code == 200
        finally:
            sync.gate.set()


def test_durable_responses_bool_still_configures_the_level() -> None:
    assert LedgerSettings().durability == "process"
    assert LedgerSettings.model_validate({"durable_responses": True}).durability == "fsync"
    assert LedgerSettings.model_validate({"durable_responses": False}).durability == "none"
    assert LedgerSettings.model_validate({"durable_responses": True, "durability": "fsync"}).durability == "fsync"
    with pytest.raises(ValidationError, match="contradicts"):
        LedgerSettings.model_validate({"durable_responses": False, "durability": "process"})
    with pytest.raises(ValidationError, match="durability"):
        LedgerSettings.model_validate({"durability": "sometimes"})
