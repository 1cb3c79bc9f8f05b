"""``JournalWriter``: the ledger's journal side — buffer, group commit, durability waits.

``append()`` puts a record in an in-memory buffer (a lock and a list append: it never blocks
on I/O). Everything buffered is then written as one group — one write(2) at the end of the
preallocated segment, see journal.py — marked *written* and handed on (``on_written``: the syncer queues it
for the database). Who writes a group:

* records appended on a thread running an asyncio event loop (the gateway's requests) are
  written *by that loop*: by the first ``wait()`` on that loop (which then need not suspend),
  else by one callback scheduled once per loop iteration with ``call_soon`` (every record
  appended during the iteration in one group); that loop's ``process`` waiters are resumed
  right there. The loop only ever hands bytes to the kernel's page cache
  with write(2) into a segment that is already open: it never fsyncs, never opens, seals or
  rotates a segment, never retries and never waits for the journal thread (if the journal
  thread is writing or sealing at that moment, or a segment must be opened or rotated, or a
  write failed and is being retried, the group is left to the journal thread);
* the *journal thread* writes everything else: records appended where no event loop runs,
  groups the loop left to it, and it seals and rotates segments and retries failed writes.

The *sync thread* fdatasyncs the segment and marks everything written before that call
*synced*; fdatasyncs nobody waits for start at least ``SYNC_INTERVAL_S`` apart (an ``fsync``
waiter or ``wait_synced`` has one started at once). Write and sync are separate so a
``process`` waiter resumes as soon as its bytes are written, never behind an fsync: while one
fdatasync runs, new groups keep being written, and the next fdatasync covers all of them. Each
thread waits on its own condition (one lock), and is woken only when it has work: an append
wakes the journal thread only when no event loop will write the record; a written group wakes
the sync thread only if it is idle (after a sync it looks again when its interval is over, so
under steady traffic nobody wakes it).

(Why the loop writes: a group written by the journal thread cost the event loop a thread
handoff per group — the journal thread woken, the GIL handed to it and back, the waiters
resumed through call_soon_threadsafe — ~6 context switches per request at 32 concurrent
requests in ``tiergate bench gateway``, and the ``process`` answer waited for that handoff.)

``wait(level)`` resolves once everything appended so far is written (``process``: survives a
kill -9 of this process) or synced (``fsync``: survives power loss). Failures are never
swallowed: a failed write fails the waiters it covered (both levels) with ``LedgerError``,
keeps the records in memory and is retried with backoff by the journal thread (into a fresh
segment); a failed fdatasync fails the ``fsync`` waiters it covered, is retried, and moves new
groups to a fresh segment (a retried fdatasync on Linux can report success for pages whose
earlier write-back failed). The sync thread's loop is syncing.py's. Imports ledger.entries, journal,
segments, syncing and waiters only; no database.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Literal

from gateway.ledger.entries import Record
from gateway.ledger.journal import Journal, encode_lines
from gateway.ledger.segments import SegmentTracker
from gateway.ledger.syncing import SyncThread
from gateway.ledger.waiters import LedgerError, Waiter, resolve_waiter, take_waiters

log = logging.getLogger("tiergate.ledger")


# (segment seq, the group's records, the sequence number of its last record, the group's
# journal lines as written: the process applier sends these on instead of pickling the records)
OnWritten = Callable[[int, list[Record], int, bytes], None]


SYNC_INTERVAL_S = 0.01  # the least time between two fdatasyncs nobody waits for


class JournalWriter(SyncThread):
    def __init__(self, segments: SegmentTracker, on_written: OnWritten, on_finished: Callable[[], None], *,
                 retry_max_s: float = 5.0, sync_interval_s: float = SYNC_INTERVAL_S) -> None:
        self._segments = segments
        self._sync_interval_s = sync_interval_s
        self._on_written = on_written  # a written group, for the database
        self._on_finished = on_finished  # the journal thread is gone: nothing more will be written
        self._retry_max_s = retry_max_s
        self.journal: Journal | None = None
        self._lock = threading.Lock()  # buffer, sequence numbers, waiters, flags
        self._cond = threading.Condition(self._lock)  # state changes, for blocking waiters (wait_synced)
        self._work = threading.Condition(self._lock)  # the journal thread waits here
        self._to_sync = threading.Condition(self._lock)  # the sync thread waits here
        self._sync_idle = False  # the sync thread waits for something to be written (not its interval)
        # Held while a group is taken from the buffer and written, and while a segment is sealed:
        # groups reach the journal in sequence order, one writer at a time. The loop only tries it.
        self._write_lock = threading.Lock()
        self._buffer: list[Record] = []
        self._seq = 0  # records appended
        self._written_seq = 0
        self._synced_seq = 0
        self._written_waiters: list[Waiter] = []
        self._synced_waiters: list[Waiter] = []
        self._blocking_sync_waits = 0  # threads in wait_synced
        self._flush_loops: set[asyncio.AbstractEventLoop] = set()  # loops with a write scheduled
        # Each loop's scheduled write, for ``wait`` to cancel when it writes the records itself (an
        # entry is only touched on its own loop's thread; a stale one is harmless: the handle ran).
        self._flush_handles: dict[asyncio.AbstractEventLoop, asyncio.Handle] = {}
        self._running = False
        self._stopping = False
        self._exited = False
        self._reseal = False  # a sync or write failed: the next group goes to a fresh segment
        self._retry_at = 0.0  # a failed write is retried (by the journal thread) from then on
        self.journal_failures = 0
        self.sync_failures = 0
        self.last_error: tuple[float, str] | None = None  # (monotonic time, message)
        self._threads: list[threading.Thread] = []

    # ---------------------------------------------------------------- lifecycle
    def start(self, journal: Journal, first_seq: int) -> None:
        """Write into ``journal``; records appended from now on are numbered after ``first_seq``
        (the records replayed from disk, which count as written and synced)."""
        self.journal = journal
        with self._lock:
            self._buffer = []
            self._seq = self._written_seq = self._synced_seq = first_seq
            self._running, self._stopping, self._exited, self._reseal = True, False, False, False
            self._retry_at = 0.0
        self._threads = [threading.Thread(target=self._journal_loop, name="ledger-journal", daemon=True),
                         threading.Thread(target=self._sync_loop, name="ledger-sync", daemon=True)]
        for t in self._threads:
            t.start()

    def request_stop(self) -> None:
        """Refuse new records; the journal thread writes what is buffered, seals and exits."""
        with self._lock:
            self._running = False
            self._stopping = True
            self._work.notify_all()

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
        loop = asyncio._get_running_loop()
        with self._lock:
            self._buffer_locked(rec)
            if loop is None:
                self._work.notify()  # no event loop here to write it: the journal thread does
                return
            if loop in self._flush_loops:
                return  # this loop writes it with the rest of this iteration's records
            self._flush_loops.add(loop)
        try:
            self._flush_handles[loop] = loop.call_soon(self._flush_on_loop, loop)
        except RuntimeError:  # the loop is closing: the journal thread writes it
            with self._lock:
                self._flush_loops.discard(loop)
                self._work.notify()

    def append_written(self, rec: Record) -> bool:
        """``append(rec)`` and, on an event loop, the write ``wait("process")`` would then do, in
        one step: ``rec`` and everything buffered written at once, no write scheduled on the loop
        only to be cancelled (what a call's intent needs before the call). True: written (survives
        a kill -9 of this process). False: only appended (no event loop here, or the journal thread
        writes it: see ``_loop_may_write``) — then ``await wait("process")``. Raises
        ``LedgerError`` if not running, or if this write failed (its records are kept and retried
        as after any failed write; the waiters it covered are failed)."""
        loop = asyncio._get_running_loop()
        if loop is None or not self._write_lock.acquire(blocking=False):
            self.append(rec)
            return False
        try:
            journal = self._journal_()
            with self._lock:
                self._buffer_locked(rec)
                if not self._loop_may_write(journal):
                    self._work.notify()
                    return False
                batch, upto = self._buffer, self._seq
                self._buffer = []
            return self._write_on_loop(journal, batch, upto, loop, raise_on_failure=True)
        finally:
            self._write_lock.release()

    def _buffer_locked(self, rec: Record) -> None:
        """Buffer ``rec`` (the lock held); raises LedgerError if not running."""
        if not self._running:
            raise LedgerError("ledger is not running")
        self._buffer.append(rec)
        self._seq += 1

    @property
    def seq(self) -> int:
        """The sequence number of the last record appended."""
        with self._lock:
            return self._seq

    async def wait(self, level: Literal["process", "fsync"]) -> None:
        """Until everything appended so far is written (``process``) or synced (``fsync``).
        Records this loop was going to write at the end of its iteration are written now: the
        waiter need not suspend for that (a suspension is an extra loop iteration, in which the
        loop lets go of the GIL, and the answer would wait behind whatever else is ready)."""
        loop = asyncio.get_running_loop()
        if loop in self._flush_loops:
            handle = self._flush_handles.pop(loop, None)
            if handle is not None:  # written here and now: the scheduled write would find nothing left to
                handle.cancel()     # write, or leave what it found to the journal thread as this does
            self._flush_on_loop(loop)
        with self._lock:
            target = self._seq
            reached = self._written_seq if level == "process" else self._synced_seq
            if reached >= target:
                return
            fut: asyncio.Future[None] = loop.create_future()
            if level == "process":
                self._written_waiters.append((target, loop, fut))
            else:
                self._synced_waiters.append((target, loop, fut))
                self._to_sync.notify()  # an fsync waiter: the sync thread does not wait out its interval
        await fut

    def wait_synced(self, timeout_s: float | None = None) -> bool:
        """Block until everything appended so far is fdatasync'd."""
        with self._lock:
            target = self._seq
            self._blocking_sync_waits += 1
            self._to_sync.notify()
            try:
                return self._cond.wait_for(lambda: self._synced_seq >= target, timeout_s)
            finally:
                self._blocking_sync_waits -= 1

    def counts(self) -> tuple[int, int, int]:
        """(records buffered, written, synced)."""
        with self._lock:
            return len(self._buffer), self._written_seq, self._synced_seq

    # ---------------------------------------------------------------- the event loop's writes
    def _flush_on_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Write what is buffered as one group, on the event loop (see the module docstring);
        anything this must not do is left to the journal thread."""
        self._flush_handles.pop(loop, None)
        with self._lock:
            self._flush_loops.discard(loop)
            if not self._buffer:
                return
        if not self._write_lock.acquire(blocking=False):
            self._leave_to_journal_thread()  # it is writing or sealing now: it takes these next
            return
        try:
            journal = self._journal_()
            with self._lock:
                if not self._buffer:
                    return
                if not self._loop_may_write(journal):
                    self._work.notify()
                    return
                batch, upto = self._buffer, self._seq
                self._buffer = []
            self._write_on_loop(journal, batch, upto, loop, raise_on_failure=False)
        finally:
            self._write_lock.release()

    def _loop_may_write(self, journal: Journal) -> bool:
        """Whether the event loop may write the buffer now (the lock held): not while stopping, or
        while a failed write or sync is being retried, or when a segment must be opened or rotated
        (the journal thread's work)."""
        return not (self._stopping or self._reseal or self.journal_failures or journal.current_seq is None
                    or journal.should_rotate())

    def _write_on_loop(self, journal: Journal, batch: list[Record], upto: int, loop: asyncio.AbstractEventLoop, *,
                       raise_on_failure: bool) -> bool:
        """The loop's write of ``batch`` (the write lock held); False (or ``LedgerError``) when it failed."""
        data = encode_lines(batch)
        try:
            seg = journal.write_lines(data)
        except OSError as exc:  # the thread seals this segment (a torn line may end it), then retries
            self._write_failed(batch, upto, exc, reseal=True)
            if raise_on_failure:
                raise LedgerError(f"ledger journal write failed: {exc}") from exc
            return False
        self._written(seg, batch, upto, data, loop)
        return True

    def _leave_to_journal_thread(self) -> None:
        with self._lock:
            self._work.notify()

    # ---------------------------------------------------------------- journal thread
    def _journal_loop(self) -> None:
        while True:
            with self._lock:
                if not self._buffer and not self._stopping:
                    self._work.wait(timeout=1.0)
                stopping = self._stopping
                delay = self._retry_at - time.monotonic()
            if delay > 0:  # a failed write: retried after its backoff
                time.sleep(delay)
            resume: list[Waiter] = []
            with self._write_lock:
                with self._lock:
                    batch, upto = self._buffer, self._seq
                    self._buffer = []
                    if batch:  # a loop whose scheduled write never ran (it stopped) schedules anew
                        self._flush_loops.clear()
                if batch:
                    resume = self._write_group(batch, upto)
                elif self._reseal or self._journal_().should_rotate():
                    self._seal_current()
            for _, loop, fut in resume:  # resumed once the write lock is free for their loops' writes
                resolve_waiter(loop, fut, None)
            if stopping and not batch:
                with self._lock:
                    if self._buffer:
                        continue
                with self._write_lock:
                    self._seal_current()
                with self._lock:
                    self._exited = True
                    self._cond.notify_all()
                    self._to_sync.notify_all()
                self._on_finished()
                return

    def _write_group(self, batch: list[Record], upto: int) -> list[Waiter]:
        """The journal thread's write (the write lock held): seals first when due; on failure
        seals the segment the failure may have torn and retries later. Returns the waiters to
        resume (after the write lock is released)."""
        journal = self._journal_()
        data = encode_lines(batch)
        try:
            if self._reseal or journal.should_rotate():
                self._seal_current()
            seg = journal.write_lines(data)
        except OSError as exc:
            self._seal_current()
            self._write_failed(batch, upto, exc)
            return []
        return self._written(seg, batch, upto, data, None)

    def _written(self, seg: int, batch: list[Record], upto: int, data: bytes,
                 loop: asyncio.AbstractEventLoop | None) -> list[Waiter]:
        """A group is in the journal (``data``: its lines as written): hand it on, wake the sync
        thread. On ``loop`` (the loop this runs on) its waiters are resumed here; from the journal
        thread (``loop`` None) the waiters to resume are returned."""
        self._segments.wrote(seg, len(batch))
        self._on_written(seg, batch, upto, data)
        with self._lock:
            self.journal_failures = 0
            self._written_seq = upto
            done = take_waiters(self._written_waiters, upto) if self._written_waiters else []
            wake_now = loop is None or bool(self._synced_waiters)
            wake_later = not wake_now and self._sync_idle
            if wake_now and self._sync_idle:
                self._to_sync.notify()  # the sync thread waits for something to sync
        if loop is None:
            return done
        for _, wloop, fut in done:  # 'written': resumed now, before this group's fdatasync
            if wloop is loop:
                if not fut.done():
                    fut.set_result(None)
            else:
                resolve_waiter(wloop, fut, None)
        if wake_later:
            # No fsync waiter: the sync thread is woken after the resumed waiters have run (their
            # answers sent), not before: woken now it would take the CPU and the GIL from them.
            loop.call_soon(self._wake_sync)
        return []

    def _wake_sync(self) -> None:
        with self._lock:
            if self._sync_idle:  # (in its interval wait it wakes by itself)
                self._to_sync.notify()

    def _write_failed(self, batch: list[Record], upto: int, exc: OSError, *, reseal: bool = False) -> None:
        """Keep the records (first in the buffer), fail the waiters they covered and schedule the
        retry (the journal thread's, after a backoff; ``reseal``: into a fresh segment)."""
        log.error("ledger journal write failed (%d record(s) kept in memory, retrying)", len(batch),
                  exc_info=exc)
        with self._lock:
            if reseal:
                self._reseal = True
            self.journal_failures += 1
            self.last_error = (time.monotonic(), f"journal: {exc}")
            self._buffer[:0] = batch
            failed = take_waiters(self._written_waiters, upto) + take_waiters(self._synced_waiters, upto)
            delay = min(0.05 * 2 ** (self.journal_failures - 1), self._retry_max_s)
            self._retry_at = time.monotonic() + delay
            self._work.notify()
        for _, loop, fut in failed:
            resolve_waiter(loop, fut, LedgerError(f"ledger journal write failed: {exc}"))

    def _seal_current(self) -> None:
        journal = self._journal_()
        self._reseal = False
        try:
            seg = journal.seal()  # syncs, then closes (closed even if the sync fails)
        except OSError as exc:
            with self._lock:
                upto = self._written_seq
            self._sync_failed(upto, exc)
            seg = journal.last_seq  # closed anyway: sealed, deletable once committed
        if seg is not None:
            self._segments.sealed(seg)
