"""The ledger's parts on their own: ``SegmentTracker`` (when a segment may go), ``JournalWriter``
(group commit and durability waits, no database) and ``JournalSyncer`` (journal → database
batches, replay, retries), each driven through its own small interface; the DB applier is
covered by test_ledger_writer.py and the whole by test_ledger_service.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from gateway.ledger import LedgerEntry, new_entry_id
from gateway.ledger.entries import Record
from gateway.ledger.journal import Journal, decode_lines, encode_lines, read_segment
from gateway.ledger.journal_writer import JournalWriter, LedgerError
from gateway.ledger.segments import SegmentTracker
from gateway.ledger.syncer import JournalSyncer
from gateway.providers.base import Usage


def entry(i: int) -> LedgerEntry:
    return LedgerEntry(new_entry_id(), f"req-{i}", "t1", None, "direct", "low", "m", Usage(i, 1), i, 2 * i)


class Deleted(list[int]):
    def __call__(self, seq: int) -> None:
        self.append(seq)


# ------------------------------------------------------------------------- SegmentTracker
def test_a_segment_goes_only_when_sealed_and_fully_applied() -> None:
    deleted = Deleted()
    tracker = SegmentTracker(deleted)
    tracker.wrote(1, 3)
    tracker.applied(1, 3)
    assert deleted == []  # still open: more may be written to it
    tracker.wrote(1, 2)
    tracker.sealed(1)
    assert deleted == []  # two records not committed yet
    tracker.applied(1, 2)
    assert deleted == [1] and tracker.open_segments() == []


def test_replayed_segments_wait_for_their_records_and_empty_ones_go_at_once() -> None:
    deleted = Deleted()
    tracker = SegmentTracker(deleted)
    tracker.replayed(4, 0)
    tracker.replayed(5, 10)
    assert deleted == [4] and tracker.open_segments() == [5]
    tracker.applied(5, 10)
    assert deleted == [4, 5]


# ------------------------------------------------------------------------- JournalWriter
class Groups:
    """Stands in for the syncer: collects the written groups (and the thread that wrote each)."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, list[Record], int]] = []
        self.writers: list[str] = []
        self.finished = threading.Event()

    def written(self, seg: int, records: list[Record], upto: int, lines: bytes) -> None:
        assert decode_lines(lines) == records  # the group's lines as the journal holds them
        self.groups.append((seg, records, upto))
        self.writers.append(threading.current_thread().name)

    def done(self) -> None:
        self.finished.set()


def _writer(tmp_path: Path, deleted: Deleted | None = None, **kwargs: float
            ) -> tuple[JournalWriter, Groups, Journal, SegmentTracker]:
    groups = Groups()
    journal = Journal(tmp_path / "j")
    journal.existing_segments()
    tracker = SegmentTracker(deleted if deleted is not None else Deleted())
    writer = JournalWriter(tracker, groups.written, groups.done, retry_max_s=0.05, **kwargs)
    return writer, groups, journal, tracker


async def test_the_event_loop_writes_its_own_groups_and_the_thread_writes_the_rest(tmp_path: Path) -> None:
    """Records appended on a running event loop are written by that loop (its waiter resumes
    without a thread handoff); records appended where no loop runs by the journal thread. Either
    way the journal holds them in order, each once."""
    writer, groups, journal, _ = _writer(tmp_path)
    writer.start(journal, 0)
    try:
        await asyncio.wait_for(asyncio.to_thread(writer.append, entry(1)), 5)  # no loop in that thread
        await asyncio.wait_for(writer.wait("process"), 5)  # the first group also opens the segment
        await asyncio.sleep(0.05)  # the journal thread is idle again (while it writes, the loop leaves groups to it)
        on_loop = [entry(i) for i in range(2, 6)]
        for r in on_loop:
            writer.append(r)
        await asyncio.wait_for(writer.wait("process"), 5)
        off_loop = entry(6)
        await asyncio.wait_for(asyncio.to_thread(writer.append, off_loop), 5)
        await asyncio.wait_for(writer.wait("process"), 5)
        assert groups.writers == ["ledger-journal", threading.current_thread().name, "ledger-journal"]
        assert [r for _, g, _ in groups.groups for r in g][1:] == [*on_loop, off_loop]
        on_disk = [r.id for p in sorted((tmp_path / "j").glob("*.jsonl")) for r in read_segment(p).records]
        assert on_disk == [r.id for _, g, _ in groups.groups for r in g]
    finally:
        writer.request_stop()
        assert writer.join(time.monotonic() + 5)


async def test_a_waiter_writes_its_loop_group_itself_and_the_scheduled_write_is_cancelled(tmp_path: Path) -> None:
    """``wait`` on the loop writes what the loop buffered at once and cancels the write the first
    append scheduled (it would find nothing left); a record nobody waits for is still written by
    that scheduled write, at the end of the loop iteration."""
    writer, groups, journal, _ = _writer(tmp_path)
    writer.start(journal, 0)
    runs: list[int] = []
    real = writer._flush_on_loop

    def counted(loop: asyncio.AbstractEventLoop) -> None:
        runs.append(1)
        real(loop)

    writer._flush_on_loop = counted  # type: ignore[method-assign]
    try:
        writer.append(entry(0))  # the first group also opens the segment: the journal thread writes it
        await asyncio.wait_for(writer.wait("process"), 5)
        await asyncio.sleep(0.05)
        runs.clear()
        waited = [entry(i) for i in range(1, 7)]
        for i in range(0, 6, 2):
            writer.append(waited[i])
            writer.append(waited[i + 1])
            await writer.wait("process")  # awaited in this task (wait_for would start a task after the scheduled write)
            await asyncio.sleep(0)  # one loop iteration: a scheduled write would run here
            await asyncio.sleep(0)
        assert len(runs) == 3  # the waiters' own writes, no scheduled one ran
        unwaited = entry(99)
        writer.append(unwaited)  # nobody waits: the scheduled write writes it
        for _ in range(100):
            if groups.groups[-1][1] == [unwaited]:
                break
            await asyncio.sleep(0.01)
        assert len(runs) == 4 and groups.groups[-1][1] == [unwaited]
        assert [g for _, g, _ in groups.groups[1:]] == [waited[0:2], waited[2:4], waited[4:6], [unwaited]]
        assert writer.counts() == (0, 8, writer.counts()[2])
    finally:
        writer.request_stop()
        assert writer.join(time.monotonic() + 5)


async def test_background_syncs_are_spaced_but_an_fsync_waiter_is_not_kept_waiting(tmp_path: Path) -> None:
    writer, _, journal, _ = _writer(tmp_path, sync_interval_s=0.5)
    syncs: list[float] = []
    real_sync = journal.sync

    def counted() -> None:
        syncs.append(time.monotonic())
        real_sync()

    journal.sync = counted  # type: ignore[method-assign]
    writer.start(journal, 0)
    try:
        started = time.monotonic()
        for i in range(20):  # 20 groups in ~0.2 s: at most one background sync starts meanwhile
            writer.append(entry(i))
            await writer.wait("process")
            await asyncio.sleep(0.01)
        assert len([t for t in syncs if t - started < 0.45]) <= 1
        writer.append(entry(99))
        t0 = time.monotonic()
        await asyncio.wait_for(writer.wait("fsync"), 5)
        assert time.monotonic() - t0 < 0.4, "an fsync waiter waited out the background sync interval"
        assert writer.counts() == (0, 21, 21)
    finally:
        writer.request_stop()
        assert writer.join(time.monotonic() + 5)


async def test_writer_groups_records_and_resolves_both_levels(tmp_path: Path) -> None:
    writer, groups, journal, _ = _writer(tmp_path)
    with pytest.raises(LedgerError, match="not running"):
        writer.append(entry(0))
    writer.start(journal, first_seq=7)  # seven records were replayed before this run
    records = [entry(i) for i in range(1, 51)]
    for r in records:
        writer.append(r)
    await asyncio.wait_for(writer.wait("process"), 5)
    assert [r for _, group, _ in groups.groups for r in group] == records  # in order, each once
    assert groups.groups[-1][2] == writer.seq == 57  # numbered after the replayed ones
    on_disk = [r for p in sorted((tmp_path / "j").glob("*.jsonl")) for r in read_segment(p).records]
    assert on_disk == records  # written before 'process' resolved
    await asyncio.wait_for(writer.wait("fsync"), 5)
    assert writer.counts() == (0, 57, 57)
    writer.request_stop()
    assert writer.join(time.monotonic() + 5) and groups.finished.is_set()
    with pytest.raises(LedgerError):
        writer.append(entry(99))


async def test_writer_seals_on_stop_and_the_tracker_deletes_once_applied(tmp_path: Path) -> None:
    deleted = Deleted()
    writer, groups, journal, tracker = _writer(tmp_path, deleted)
    journal_delete = journal.delete

    def delete(seq: int) -> None:
        deleted(seq)
        journal_delete(seq)

    tracker.reset(delete)
    writer.start(journal, 0)
    writer.append(entry(1))
    await writer.wait("process")
    writer.request_stop()
    assert writer.join(time.monotonic() + 5)
    (seg, _, _), = groups.groups
    assert deleted == [] and journal.path_for(seg).exists()  # sealed, not committed
    tracker.applied(seg, 1)
    assert deleted == [seg] and not journal.path_for(seg).exists()


async def test_append_written_writes_on_the_loop_at_once_or_leaves_the_record_to_the_journal_thread(
        tmp_path: Path) -> None:
    """``append_written`` (a call's intent): on the loop the record and what the loop buffered
    before it are written in the call itself, with no write scheduled; where the journal thread
    must write (here: the first group opens the segment) it only appends, and ``wait`` covers
    it; a failed write raises at once, keeps the records and is retried."""
    writer, groups, journal, _ = _writer(tmp_path)
    es = [entry(i) for i in range(5)]
    real_write = journal.write_lines
    fail = {"next": False}

    def flaky(data: bytes) -> int:
        if fail["next"]:
            fail["next"] = False
            raise OSError(28, "No space left on device")
        return real_write(data)

    journal.write_lines = flaky  # type: ignore[method-assign]
    writer.start(journal, 0)
    runs: list[int] = []
    real = writer._flush_on_loop
    writer._flush_on_loop = lambda loop: (runs.append(1), real(loop))[1]  # type: ignore[method-assign]
    try:
        assert writer.append_written(es[0]) is False  # no segment open yet: the journal thread's work
        await asyncio.wait_for(writer.wait("process"), 5)
        await asyncio.sleep(0.05)
        writer.append(es[1])  # buffered on this loop, a write scheduled
        assert writer.append_written(es[2]) is True  # both written now, in one group
        assert writer.counts()[:2] == (0, 3) and groups.writers[-1] == threading.current_thread().name
        assert [r.id for r in groups.groups[-1][1]] == [es[1].id, es[2].id]
        assert writer.append_written(es[3]) is True and writer.counts()[:2] == (0, 4)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert runs == [1]  # only the write es[1] scheduled ran, and found nothing left
        fail["next"] = True
        with pytest.raises(LedgerError, match="No space left"):
            writer.append_written(es[4])
        assert writer.journal_failures == 1
        for _ in range(200):  # kept in memory and retried by the journal thread
            if writer.journal_failures == 0 and writer.counts()[1] == 5:
                break
            await asyncio.sleep(0.01)
        assert writer.counts()[:2] == (0, 5) and groups.groups[-1][1] == [es[4]]
        on_disk = [r.id for p in sorted((tmp_path / "j").glob("*.jsonl")) for r in read_segment(p).records]
        assert on_disk == [e.id for e in es]
    finally:
        writer.request_stop()
        assert writer.join(time.monotonic() + 5)


async def test_writer_write_failure_fails_waiters_then_retries_into_a_fresh_segment(tmp_path: Path) -> None:
    writer, groups, journal, _ = _writer(tmp_path)
    real_write = journal.write_lines  # the writer's one write(2) per group
    calls = {"n": 0}

    def flaky(data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real_write(data)

    journal.write_lines = flaky  # type: ignore[method-assign]
    writer.start(journal, 0)
    writer.append(entry(1))
    with pytest.raises(LedgerError, match="No space left"):
        await asyncio.wait_for(writer.wait("process"), 5)
    for _ in range(200):  # retried from memory
        if groups.groups:
            break
        await asyncio.sleep(0.01)
    assert [len(g) for _, g, _ in groups.groups] == [1] and writer.journal_failures == 0
    assert writer.last_error is not None and "No space left" in writer.last_error[1]
    writer.request_stop()
    assert writer.join(time.monotonic() + 5)


# ------------------------------------------------------------------------- JournalSyncer
class Db:
    """Stands in for the DB applier: fails ``fail`` times, then commits."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.batches: list[list[Record]] = []

    def apply(self, records: Sequence[Record]) -> None:
        if self.fail:
            self.fail -= 1
            raise ConnectionError("database unreachable")
        self.batches.append(list(records))


def test_syncer_batches_and_reports_what_is_committed() -> None:
    db, deleted = Db(), Deleted()
    tracker = SegmentTracker(deleted)
    syncer = JournalSyncer(db.apply, tracker, batch_size=4, flush_interval_ms=5, retry_max_s=0.05)
    assert syncer.replay([]) == 0
    syncer.start()
    records: list[Record] = [entry(i) for i in range(10)]
    for i in range(0, 10, 2):
        tracker.wrote(1, 2)
        syncer.enqueue(1, records[i:i + 2], i + 2)
    tracker.sealed(1)
    assert syncer.wait_applied(10, 5)
    assert [r for b in db.batches for r in b] == records and max(len(b) for b in db.batches) <= 4
    assert syncer.counts() == (0, 10) and deleted == [1]
    syncer.journal_finished()
    assert syncer.join(time.monotonic() + 5)


def test_syncer_hands_batches_on_as_journal_lines_where_asked(tmp_path: Path) -> None:
    """With ``apply_lines`` (the process applier) each batch arrives as the journal lines of its
    records, in order, with their count: the groups' own lines where the writer gave them, lines
    encoded from the records of a replayed segment otherwise; nothing goes to ``apply``."""
    journal = Journal(tmp_path / "j")
    journal.existing_segments()
    old: list[Record] = [entry(i) for i in range(3)]
    journal.append(old)
    journal.seal()
    db, batches = Db(), []
    tracker = SegmentTracker(journal.delete)

    def apply_lines(lines: bytes, count: int) -> None:
        records = decode_lines(lines)
        assert len(records) == count
        batches.append(records)

    syncer = JournalSyncer(db.apply, tracker, batch_size=4, flush_interval_ms=5, apply_lines=apply_lines)
    assert syncer.replay(journal.existing_segments()) == 3
    syncer.start()
    new: list[Record] = [entry(10 + i) for i in range(6)]
    for i in range(0, 6, 2):
        tracker.wrote(7, 2)
        syncer.enqueue(7, new[i:i + 2], 3 + i + 2, encode_lines(new[i:i + 2]))
    tracker.sealed(7)
    assert syncer.wait_applied(9, 5)
    assert [r for b in batches for r in b] == old + new and max(len(b) for b in batches) <= 4
    assert db.batches == [] and syncer.counts() == (0, 9)
    assert journal.existing_segments() == []  # the replayed segment too: committed, deleted
    syncer.journal_finished()
    assert syncer.join(time.monotonic() + 5)


def test_a_waiter_that_urges_does_not_wait_out_the_flush_interval() -> None:
    """Rows queued for the database wait up to ``flush_interval_ms`` to be batched, except those
    someone waits for with ``urge`` (``Ledger.flush``): written at once."""
    db = Db()
    syncer = JournalSyncer(db.apply, SegmentTracker(Deleted()), flush_interval_ms=60_000)
    syncer.replay([])
    syncer.start()
    syncer.enqueue(1, [entry(1)], 1)
    assert not syncer.wait_applied(1, 0.3)  # batched: waits for the interval (a minute here)
    assert syncer.wait_applied(1, 5, urge=True) and len(db.batches) == 1
    syncer.enqueue(1, [entry(2)], 2)
    assert not syncer.wait_applied(2, 0.3)  # the urge covered records up to #1 only
    syncer.begin_stop()
    syncer.journal_finished()
    assert syncer.join(time.monotonic() + 5) and syncer.counts() == (0, 2)


def test_decoding_lines_refuses_a_bad_line_instead_of_skipping_it() -> None:
    lines = encode_lines([entry(1), entry(2)])
    assert [r.id for r in decode_lines(lines)] == [r.id for r in decode_lines(lines[:-1])]  # final newline optional
    corrupt = lines.replace(b'"req-2"', b'"req-3"')  # the second line's checksum no longer matches
    with pytest.raises(ValueError, match="undecodable"):
        decode_lines(corrupt)


def test_syncer_retries_a_failing_database_and_surfaces_it() -> None:
    db = Db(fail=3)
    syncer = JournalSyncer(db.apply, SegmentTracker(Deleted()), flush_interval_ms=1, retry_max_s=0.02)
    syncer.replay([])
    syncer.start()
    syncer.enqueue(1, [entry(1)], 1)
    for _ in range(500):
        if syncer.failures:
            break
        time.sleep(0.001)
    assert syncer.last_error is not None and "ConnectionError" in syncer.last_error[1]
    assert syncer.wait_applied(1, 5) and syncer.failures == 0 and len(db.batches) == 1
    syncer.journal_finished()
    assert syncer.join(time.monotonic() + 5)


def test_syncer_replays_old_segments_first_and_abandons_at_the_deadline(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.existing_segments()
    old = [entry(i) for i in range(5)]
    journal.append(old[:3])
    journal.seal()
    journal.append(old[3:])
    journal.seal()
    db = Db(fail=10**6)  # the database never comes back
    syncer = JournalSyncer(db.apply, SegmentTracker(Deleted()), batch_size=2, retry_max_s=0.05)
    assert syncer.replay(journal.existing_segments()) == 5
    syncer.start()
    syncer.begin_stop()
    syncer.journal_finished()
    assert not syncer.wait_applied(5, 0.2)
    assert syncer.join(time.monotonic() + 0.2)  # gave up: the records stay in the journal
    assert syncer.counts() == (5, 0)

    db.fail = 0
    replay = JournalSyncer(db.apply, SegmentTracker(journal.delete), batch_size=2)
    assert replay.replay(journal.existing_segments()) == 5
    replay.start()
    assert replay.wait_applied(5, 5)
    assert [r.id for b in db.batches for r in b] == [r.id for r in old]  # in journal order
    replay.journal_finished()
    assert replay.join(time.monotonic() + 5)
    assert journal.existing_segments() == []  # sealed and committed: deleted
