"""``Ledger``: lossless, non-blocking recording of every upstream call and every request.

Path of a record: ``record()`` appends it to an in-memory buffer (a lock and a list append:
it never blocks on I/O) → the *journal thread* writes everything buffered as one group
(one write(2) to the O_APPEND segment, see journal.py) and marks it *written* → the *sync
thread* fdatasyncs the segment and marks everything written before that call *synced* →
the *DB thread* writes
journaled records to the database in batches (``batch_size`` rows or every
``flush_interval_ms``) idempotently (writer.py) → a journal segment is deleted only once it
is sealed and every record in it is committed. ``start()`` replays segments left by a crash.

Durability levels (``Durability``; ``await wait_durable(level)`` after ``record(...)``, or
``await record_durable(entry, level)``), from cheapest to safest:

* ``none``: ``record()`` alone returns before the record reaches the journal; a kill -9 within
  a few milliseconds can lose it.
* ``process`` (the chat path's default): resolves once the record's group was written with
  write(2). The bytes are then in the kernel's page cache, so a kill -9 (or any crash) of this
  process loses nothing; a power loss or kernel crash can lose what was written since the last
  fdatasync, i.e. at most about one sync interval (one fdatasync, a few ms) of records.
* ``fsync``: resolves only after the fdatasync that covers the record (survives power loss),
  at the cost of one fsync of latency (~4 ms on the development disk).

Write and sync are split across two threads so a ``process`` waiter resumes as soon as its
bytes are written, never behind an fsync: while the sync thread runs one fdatasync, the
journal thread keeps writing new groups (group commit: one write for every record buffered
meanwhile), and the next fdatasync covers all of them. Throughput grows with concurrency
(thousands of rows/s); neither write nor fsync ever runs on the event loop.

Failures are never swallowed: a failed journal write fails the waiting callers (both levels)
with ``LedgerError`` and is retried; a failed fdatasync fails the ``fsync`` waiters it covered,
is logged, shows in ``health()`` and is retried (the records are also on their way to the
database, their real home); a failed DB write is logged with its traceback,
kept (journal and memory) and retried with exponential backoff; ``health()`` reports it for
/readyz. Known limit: during a long DB outage the pending records are also held in memory
(a few hundred bytes each); ``health().pending_db`` shows how many. Must not import web frameworks, the pipeline or the app.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sqlalchemy.orm import Session, sessionmaker

from gateway.ledger.applier import write_batch
from gateway.ledger.entries import LedgerEntry, Record, RequestRecord
from gateway.ledger.journal import Journal, claim_writer_dir, read_segment, release_journal_dir
from gateway.ledger.waiters import Waiter, resolve_waiter, take_waiters
from gateway.log_safety import describe

log = logging.getLogger("tiergate.ledger")

Durability = Literal["process", "fsync", "none"]
DURABILITY_LEVELS: tuple[Durability, ...] = ("process", "fsync", "none")


class LedgerError(RuntimeError):
    """The ledger could not make a record durable, or is not running."""


@dataclass(frozen=True)
class LedgerHealth:
    ok: bool
    running: bool
    pending_journal: int
    pending_db: int
    consecutive_failures: int
    last_error: str | None
    records_durable: int          # fdatasync'd in the journal (survive power loss)
    records_committed: int
    records_written: int = 0      # written to the journal (survive kill -9 of this process)


@dataclass
class _Segment:
    written: int = 0
    applied: int = 0
    sealed: bool = False


@dataclass
class _DbItem:
    segment: int
    records: list[Record]
    upto_seq: int
    attempts: int = field(default=0)


class Ledger:
    def __init__(self, session_factory: sessionmaker[Session], journal_dir: str | Path,
                 flush_interval_ms: int = 50, batch_size: int = 500, *,
                 max_segment_bytes: int = 16 * 1024 * 1024, max_segment_age_s: float = 10.0,
                 retry_max_s: float = 5.0) -> None:
        self._session_factory = session_factory
        self._journal_root = Path(journal_dir)
        self._max_segment_bytes = max_segment_bytes
        self._max_segment_age_s = max_segment_age_s
        self._journal = Journal(self._journal_root, max_segment_bytes=max_segment_bytes,
                                max_segment_age_s=max_segment_age_s)
        self._dir_lock: int | None = None
        self._flush_s = flush_interval_ms / 1000
        self._batch_size = batch_size
        self._retry_max_s = retry_max_s
        self._cond = threading.Condition()          # buffer, seqs, waiters
        self._db_cond = threading.Condition()       # DB queue, applied seq
        self._buffer: list[Record] = []
        self._seq = 0
        self._written_seq = 0
        self._durable_seq = 0       # synced
        self._applied_seq = 0
        self._written_waiters: list[Waiter] = []
        self._waiters: list[Waiter] = []  # synced waiters
        self._db_queue: deque[_DbItem] = deque()
        self._segments: dict[int, _Segment] = {}
        self._seg_lock = threading.Lock()
        self._running = False
        self._stopping = False
        self._journal_done = False
        self._journal_exited = False
        self._abandon_db = False
        self._failures = 0
        self._journal_failures = 0
        self._sync_failures = 0
        self._reseal = False        # a sync failed: the next group goes to a fresh segment
        self._last_error: str | None = None
        self._threads: list[threading.Thread] = []

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Replay journal segments left from a previous run (queued ahead of new records),
        then start the journal and DB threads. Does not wait for the replay to commit."""
        if self._running:
            return
        # Anything not committed by a previous run in this process is still on disk.
        self._db_queue.clear()
        self._segments.clear()
        own_dir, self._dir_lock = claim_writer_dir(self._journal_root)
        self._journal = Journal(own_dir, max_segment_bytes=self._max_segment_bytes,
                                max_segment_age_s=self._max_segment_age_s)
        for path in self._journal.existing_segments():
            contents = read_segment(path)
            if contents.skipped_lines:
                log.warning("ledger journal %s: skipped %d torn or corrupt line(s)", path, contents.skipped_lines)
            self._segments[contents.seq] = _Segment(written=len(contents.records), sealed=True)
            if not contents.records:
                self._maybe_delete(contents.seq)
            for i in range(0, len(contents.records), self._batch_size):
                chunk = contents.records[i:i + self._batch_size]
                self._seq += len(chunk)
                self._db_queue.append(_DbItem(contents.seq, chunk, self._seq))
        self._durable_seq = self._written_seq = self._seq
        if self._db_queue:
            log.info("ledger: replaying %d journaled record(s)", self._seq)
        self._running, self._stopping, self._journal_done, self._abandon_db = True, False, False, False
        self._journal_exited = False
        self._threads = [threading.Thread(target=self._journal_loop, name="ledger-journal", daemon=True),
                         threading.Thread(target=self._db_loop, name="ledger-db", daemon=True),
                         threading.Thread(target=self._sync_loop, name="ledger-sync", daemon=True)]
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Journal everything buffered, then commit as much as possible within ``timeout_s``.
        Returns True when everything reached the database; otherwise what is left stays in
        the journal for the next start (and an error is logged)."""
        if not self._running:
            return True
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._running = False
            self._stopping = True
            self._cond.notify_all()
        with self._db_cond:
            self._db_cond.notify_all()
        journal_thread, db_thread, sync_thread = self._threads
        journal_thread.join(max(deadline - time.monotonic(), 0.1))
        sync_thread.join(max(deadline - time.monotonic(), 0.1))
        db_thread.join(max(deadline - time.monotonic(), 0.1))
        if db_thread.is_alive():
            with self._db_cond:
                self._abandon_db = True
                self._db_cond.notify_all()
            db_thread.join(self._retry_max_s + 1)
        left = len(self._db_queue) + len(self._buffer)
        if left:
            log.error("ledger stopped with %d record(s) not committed; they stay in the journal", left)
        if self._dir_lock is not None and not any(t.is_alive() for t in self._threads):
            release_journal_dir(self._journal_root, self._journal.directory, self._dir_lock)
            self._dir_lock = None
        return left == 0

    async def astop(self, timeout_s: float = 10.0) -> bool:
        return await asyncio.to_thread(self.stop, timeout_s)

    # ---------------------------------------------------------------- recording
    def record(self, entry: LedgerEntry) -> None:
        """Queue one upstream call. Never blocks on I/O; raises LedgerError if not running."""
        self._append(entry, LedgerEntry)

    def record_request(self, rec: RequestRecord) -> None:
        """Queue a request record (upsert by id; a final status overwrites in_progress)."""
        self._append(rec, RequestRecord)

    def _append(self, rec: Record, kind: type) -> None:
        if not isinstance(rec, kind):
            raise TypeError(f"expected {kind.__name__}, got {type(rec).__name__}")
        with self._cond:
            if not self._running:
                raise LedgerError("ledger is not running")
            self._buffer.append(rec)
            self._seq += 1
            self._cond.notify()

    async def record_durable(self, entry: LedgerEntry, level: Durability = "fsync") -> None:
        """Record ``entry`` and return once it is durable at ``level`` (see the module docstring)."""
        self.record(entry)
        await self.wait_durable(level)

    async def wait_durable(self, level: Durability = "fsync") -> None:
        """Wait until everything recorded so far is durable at ``level``: ``process`` = written to
        the journal (survives kill -9), ``fsync`` = fdatasync'd (survives power loss), ``none`` =
        no wait. Raises ``LedgerError`` if the journal write (or, for ``fsync``, the sync) failed."""
        if level == "none":
            return
        if level not in ("process", "fsync"):
            raise ValueError(f"unknown durability level {level!r}")
        loop = asyncio.get_running_loop()
        with self._cond:
            target = self._seq
            reached = self._written_seq if level == "process" else self._durable_seq
            if reached >= target:
                return
            fut: asyncio.Future[None] = loop.create_future()
            (self._written_waiters if level == "process" else self._waiters).append((target, loop, fut))
        await fut

    def wait_durable_sync(self, timeout_s: float | None = None) -> bool:
        """Block until everything recorded so far is fdatasync'd in the journal."""
        with self._cond:
            target = self._seq
            return self._cond.wait_for(lambda: self._durable_seq >= target, timeout_s)

    def flush(self, timeout_s: float | None = 10.0) -> bool:
        """Block until everything recorded so far is committed to the database."""
        with self._cond:
            target = self._seq
        with self._db_cond:
            return self._db_cond.wait_for(lambda: self._applied_seq >= target, timeout_s)

    async def aflush(self, timeout_s: float | None = 10.0) -> bool:
        return await asyncio.to_thread(self.flush, timeout_s)

    def health(self) -> LedgerHealth:
        with self._cond, self._db_cond:
            pending_db = sum(len(i.records) for i in self._db_queue)
            failures = self._failures + self._journal_failures + self._sync_failures
            return LedgerHealth(ok=failures == 0, running=self._running, pending_journal=len(self._buffer),
                                pending_db=pending_db, consecutive_failures=failures,
                                last_error=self._last_error, records_durable=self._durable_seq,
                                records_committed=self._applied_seq, records_written=self._written_seq)

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
                self._journal_batch(batch, upto)
            elif self._reseal or self._journal.should_rotate():
                self._seal_current()
            if stopping and not batch:
                with self._cond:
                    if self._buffer:
                        continue
                self._seal_current()
                with self._cond:
                    self._journal_exited = True
                    self._cond.notify_all()
                with self._db_cond:
                    self._journal_done = True
                    self._db_cond.notify_all()
                return

    def _journal_batch(self, batch: list[Record], upto: int) -> None:
        try:
            if self._reseal or self._journal.should_rotate():
                self._seal_current()
            seg = self._journal.write(batch)
        except OSError as exc:
            self._seal_current()
            self._journal_failed(batch, upto, exc)
            return
        with self._seg_lock:
            self._segments.setdefault(seg, _Segment()).written += len(batch)
        with self._db_cond:
            self._db_queue.append(_DbItem(seg, batch, upto))
            self._db_cond.notify_all()
        with self._cond:
            self._journal_failures = 0
            self._written_seq = upto
            done = take_waiters(self._written_waiters, upto)
            self._cond.notify_all()  # wakes the sync thread
        for _, loop, fut in done:  # 'written': resumed now, before this group's fdatasync
            resolve_waiter(loop, fut, None)

    def _journal_failed(self, batch: list[Record], upto: int, exc: OSError) -> None:
        log.error("ledger journal write failed (%d record(s) kept in memory, retrying)", len(batch),
                  exc_info=exc)
        with self._cond:
            self._journal_failures += 1
            self._last_error = f"journal: {exc}"
            self._buffer[:0] = batch
            failed = take_waiters(self._written_waiters, upto) + take_waiters(self._waiters, upto)
            delay = min(0.05 * 2 ** (self._journal_failures - 1), self._retry_max_s)
        for _, loop, fut in failed:
            resolve_waiter(loop, fut, LedgerError(f"ledger journal write failed: {exc}"))
        time.sleep(delay)

    # ---------------------------------------------------------------- sync thread
    def _sync_loop(self) -> None:
        """fdatasync whatever the journal thread has written; exits after the journal thread."""
        while True:
            with self._cond:
                while self._durable_seq >= self._written_seq and not self._journal_exited:
                    self._cond.wait(timeout=1.0)
                if self._durable_seq >= self._written_seq:
                    return  # journal thread gone, everything synced (its last seal synced too)
                target = self._written_seq
            try:
                self._journal.sync()  # covers every write that returned before target was read
            except OSError as exc:
                self._sync_failed(target, exc)
                continue
            with self._cond:
                self._sync_failures = 0
                self._durable_seq = max(self._durable_seq, target)
                done = take_waiters(self._waiters, target)
                self._cond.notify_all()
            for _, loop, fut in done:
                resolve_waiter(loop, fut, None)

    def _sync_failed(self, upto: int, exc: OSError) -> None:
        """A failed fdatasync: the records stay written (kill -9 safe) and queued for the DB, but
        the ``fsync`` waiters covered by it are failed, not told 'on disk'; retried with backoff, and
        new groups go to a fresh segment (a retried fdatasync on Linux can report success for pages
        whose earlier write-back failed, so the failed file is not trusted for new records)."""
        log.error("ledger journal fdatasync failed (records up to #%d not known to be on disk, retrying)",
                  upto, exc_info=exc)
        with self._cond:
            self._sync_failures += 1
            self._last_error = f"journal sync: {exc}"
            self._reseal = True
            failed = take_waiters(self._waiters, upto)
            delay = min(0.05 * 2 ** (self._sync_failures - 1), self._retry_max_s)
        for _, loop, fut in failed:
            resolve_waiter(loop, fut, LedgerError(f"ledger journal sync failed: {exc}"))
        time.sleep(delay)

    def _seal_current(self) -> None:
        self._reseal = False
        try:
            seg = self._journal.seal()  # syncs, then closes (closed even if the sync fails)
        except OSError as exc:
            with self._cond:
                upto = self._written_seq
            self._sync_failed(upto, exc)
            seg = self._journal.last_seq  # closed anyway: sealed, deletable once committed
        if seg is None:
            return
        with self._seg_lock:
            self._segments.setdefault(seg, _Segment()).sealed = True
        self._maybe_delete(seg)

    def _maybe_delete(self, seg: int) -> None:
        with self._seg_lock:
            state = self._segments.get(seg)
            if state is None or not state.sealed or state.applied < state.written:
                return
            del self._segments[seg]
        self._journal.delete(seg)

    # ---------------------------------------------------------------- DB thread
    def _take_db_batch(self) -> list[_DbItem] | None:
        """Wait for a batch worth writing; None means: exit."""
        with self._db_cond:
            deadline = time.monotonic() + self._flush_s
            while True:
                queued = sum(len(i.records) for i in self._db_queue)
                if self._abandon_db or (self._journal_done and not queued):
                    return None
                if queued and (queued >= self._batch_size or self._stopping
                               or time.monotonic() >= deadline):
                    break
                self._db_cond.wait(timeout=max(deadline - time.monotonic(), 0.001) if queued else 1.0)
            items: list[_DbItem] = []
            n = 0
            for item in self._db_queue:
                if items and n + len(item.records) > self._batch_size:
                    break
                items.append(item)
                n += len(item.records)
            return items

    def _db_loop(self) -> None:
        while True:
            items = self._take_db_batch()
            if items is None:
                return
            try:
                write_batch(self._session_factory, [r for i in items for r in i.records])
            except Exception as exc:
                self._db_failed(len(items), exc)
                continue
            with self._db_cond:
                for _ in items:
                    self._db_queue.popleft()
                self._failures = 0
                self._applied_seq = max(self._applied_seq, items[-1].upto_seq)
                self._db_cond.notify_all()
            for item in items:
                with self._seg_lock:
                    state = self._segments.setdefault(item.segment, _Segment())
                    state.applied += len(item.records)
                self._maybe_delete(item.segment)

    def _db_failed(self, n_items: int, exc: Exception) -> None:
        with self._db_cond:
            self._failures += 1
            self._last_error = f"database: {type(exc).__name__}: {exc}"[:500]
            delay = min(0.05 * 2 ** (self._failures - 1), self._retry_max_s)
            log.error("ledger DB write failed (attempt %d, %d batch(es) kept in the journal, retry in %.2fs): %s",
                      self._failures, n_items, delay, describe(exc))
            self._db_cond.wait_for(lambda: self._abandon_db, timeout=delay)
