"""``JournalWriter``: the ledger's journal side — buffer, group commit, durability waits.

``append()`` puts a record in an in-memory buffer (a lock and a list append: it never blocks
on I/O). The *journal thread* writes everything buffered as one group (one write(2) to the
O_APPEND segment, see journal.py), marks it *written* and hands it on (``on_written``: the
syncer queues it for the database). The *sync thread* fdatasyncs the segment and marks
everything written before that call *synced*. Write and sync run on two threads so a
``process`` waiter resumes as soon as its bytes are written, never behind an fsync: while one
fdatasync runs, new groups keep being written, and the next fdatasync covers all of them.

``wait(level)`` resolves once everything appended so far is written (``process``: survives a
kill -9 of this process) or synced (``fsync``: survives power loss). Failures are never
swallowed: a failed write fails the waiters it covered (both levels) with ``LedgerError``,
keeps the records in memory and is retried with backoff (into a fresh segment); a failed
fdatasync fails the ``fsync`` waiters it covered, is retried, and moves new groups to a fresh
segment (a retried fdatasync on Linux can report success for pages whose earlier write-back
failed). Imports ledger.entries, journal, segments and waiters only; no database.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Literal

from gateway.ledger.entries import Record
from gateway.ledger.journal import Journal
from gateway.ledger.segments import SegmentTracker
from gateway.ledger.waiters import Waiter, resolve_waiter, take_waiters

log = logging.getLogger("tiergate.ledger")


class LedgerError(RuntimeError):
    """The ledger could not make a record durable, or is not running."""


# (segment seq, the group's records, the sequence number of its last record)
OnWritten = Callable[[int, list[Record], int], None]


class JournalWriter:
    def __init__(self, segments: SegmentTracker, on_written: OnWritten, on_finished: Callable[[], None], *,
                 retry_max_s: float = 5.0) -> None:
        self._segments = segments
        self._on_written = on_written  # a written group, for the database
        self._on_finished = on_finished  # the journal thread is gone: nothing more will be written
        self._retry_max_s = retry_max_s
        self.journal: Journal | None = None
        self._cond = threading.Condition()  # buffer, sequence numbers, waiters, flags
        self._buffer: list[Record] = []
        self._seq = 0  # records appended
        self._written_seq = 0
        self._synced_seq = 0
        self._written_waiters: list[Waiter] = []
        self._synced_waiters: list[Waiter] = []
        self._running = False
        self._stopping = False
        self._exited = False
        self._reseal = False  # a sync failed: the next group goes to a fresh segment
        self.journal_failures = 0
        self.sync_failures = 0
        self.last_error: tuple[float, str] | None = None  # (monotonic time, message)
        self._threads: list[threading.Thread] = []

    # ---------------------------------------------------------------- lifecycle
    def start(self, journal: Journal, first_seq: int) -> None:
        """Write into ``journal``; records appended from now on are numbered after ``first_seq``
        (the records replayed from disk, which count as written and synced)."""
        self.journal = journal
        with self._cond:
            self._buffer = []
            self._seq = self._written_seq = self._synced_seq = first_seq
            self._running, self._stopping, self._exited, self._reseal = True, False, False, False
        self._threads = [threading.Thread(target=self._journal_loop, name="ledger-journal", daemon=True),
                         threading.Thread(target=self._sync_loop, name="ledger-sync", daemon=True)]
        for t in self._threads:
            t.start()

    def request_stop(self) -> None:
        """Refuse new records; the journal thread writes what is buffered, seals and exits."""
        with self._cond:
            self._running = False
            self._stopping = True
            self._cond.notify_all()

    def join(self, deadline: float) -> bool:
        """Wait (until ``deadline``, monotonic) for both threads; True when both are gone."""
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0.1))
        return not any(t.is_alive() for t in self._threads)

    @property
    def running(self) -> bool:
        return self._running

    # ---------------------------------------------------------------- appending and waiting
    def append(self, rec: Record) -> None:
        """Buffer one record. Never blocks on I/O; raises LedgerError if not running."""
        with self._cond:
            if not self._running:
                raise LedgerError("ledger is not running")
            self._buffer.append(rec)
            self._seq += 1
            self._cond.notify()

    @property
    def seq(self) -> int:
        """The sequence number of the last record appended."""
        with self._cond:
            return self._seq

    async def wait(self, level: Literal["process", "fsync"]) -> None:
        """Until everything appended so far is written (``process``) or synced (``fsync``)."""
        loop = asyncio.get_running_loop()
        with self._cond:
            target = self._seq
            reached = self._written_seq if level == "process" else self._synced_seq
            if reached >= target:
                return
            fut: asyncio.Future[None] = loop.create_future()
            (self._written_waiters if level == "process" else self._synced_waiters).append((target, loop, fut))
        await fut

    def wait_synced(self, timeout_s: float | None = None) -> bool:
        """Block until everything appended so far is fdatasync'd."""
        with self._cond:
            target = self._seq
            return self._cond.wait_for(lambda: self._synced_seq >= target, timeout_s)

    def counts(self) -> tuple[int, int, int]:
        """(records buffered, written, synced)."""
        with self._cond:
            return len(self._buffer), self._written_seq, self._synced_seq

    # ---------------------------------------------------------------- journal thread
    def _journal_loop(self) -> None:
        while True:
            with self._cond:
                if not self._buffer and not self._stopping:
                    self._cond.wait(timeout=1.0)
                batch, upto = self._buffer, self._seq
                self._buffer = []
                stopping = self._stopping
            if batch:
                self._write_group(batch, upto)
            elif self._reseal or self._journal_().should_rotate():
                self._seal_current()
            if stopping and not batch:
                with self._cond:
                    if self._buffer:
                        continue
                self._seal_current()
                with self._cond:
                    self._exited = True
                    self._cond.notify_all()
                self._on_finished()
                return

    def _write_group(self, batch: list[Record], upto: int) -> None:
        journal = self._journal_()
        try:
            if self._reseal or journal.should_rotate():
                self._seal_current()
            seg = journal.write(batch)
        except OSError as exc:
            self._seal_current()
            self._write_failed(batch, upto, exc)
            return
        self._segments.wrote(seg, len(batch))
        self._on_written(seg, batch, upto)
        with self._cond:
            self.journal_failures = 0
            self._written_seq = upto
            done = take_waiters(self._written_waiters, upto)
            self._cond.notify_all()  # wakes the sync thread
        for _, loop, fut in done:  # 'written': resumed now, before this group's fdatasync
            resolve_waiter(loop, fut, None)

    def _write_failed(self, batch: list[Record], upto: int, exc: OSError) -> None:
        log.error("ledger journal write failed (%d record(s) kept in memory, retrying)", len(batch),
                  exc_info=exc)
        with self._cond:
            self.journal_failures += 1
            self.last_error = (time.monotonic(), f"journal: {exc}")
            self._buffer[:0] = batch
            failed = take_waiters(self._written_waiters, upto) + take_waiters(self._synced_waiters, upto)
            delay = min(0.05 * 2 ** (self.journal_failures - 1), self._retry_max_s)
        for _, loop, fut in failed:
            resolve_waiter(loop, fut, LedgerError(f"ledger journal write failed: {exc}"))
        time.sleep(delay)

    def _seal_current(self) -> None:
        journal = self._journal_()
        self._reseal = False
        try:
            seg = journal.seal()  # syncs, then closes (closed even if the sync fails)
        except OSError as exc:
            with self._cond:
                upto = self._written_seq
            self._sync_failed(upto, exc)
            seg = journal.last_seq  # closed anyway: sealed, deletable once committed
        if seg is not None:
            self._segments.sealed(seg)

    # ---------------------------------------------------------------- sync thread
    def _sync_loop(self) -> None:
        """fdatasync whatever the journal thread has written; exits after the journal thread."""
        journal = self._journal_()
        while True:
            with self._cond:
                while self._synced_seq >= self._written_seq and not self._exited:
                    self._cond.wait(timeout=1.0)
                if self._synced_seq >= self._written_seq:
                    return  # journal thread gone, everything synced (its last seal synced too)
                target = self._written_seq
            try:
                journal.sync()  # covers every write that returned before target was read
            except OSError as exc:
                self._sync_failed(target, exc)
                continue
            with self._cond:
                self.sync_failures = 0
                self._synced_seq = max(self._synced_seq, target)
                done = take_waiters(self._synced_waiters, target)
                self._cond.notify_all()
            for _, loop, fut in done:
                resolve_waiter(loop, fut, None)

    def _sync_failed(self, upto: int, exc: OSError) -> None:
        """A failed fdatasync: the records stay written (kill -9 safe) and queued for the DB, but
        the ``fsync`` waiters covered by it are failed, not told 'on disk'; retried with backoff,
        and new groups go to a fresh segment."""
        log.error("ledger journal fdatasync failed (records up to #%d not known to be on disk, retrying)",
                  upto, exc_info=exc)
        with self._cond:
            self.sync_failures += 1
            self.last_error = (time.monotonic(), f"journal sync: {exc}")
            self._reseal = True
            failed = take_waiters(self._synced_waiters, upto)
            delay = min(0.05 * 2 ** (self.sync_failures - 1), self._retry_max_s)
        for _, loop, fut in failed:
            resolve_waiter(loop, fut, LedgerError(f"ledger journal sync failed: {exc}"))
        time.sleep(delay)

    def _journal_(self) -> Journal:
        if self.journal is None:
            raise LedgerError("ledger journal writer was never started")
        return self.journal
