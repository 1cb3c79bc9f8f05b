"""``Ledger``: lossless, non-blocking recording of every upstream call and every request.

A façade over three parts, each in its own module:

* ``JournalWriter`` (journal_writer.py): ``record()`` buffers; the event loop that recorded
  (or, where none runs, a journal thread) writes groups to the append-only journal (group
  commit), a sync thread fdatasyncs them; durability waits.
* ``JournalSyncer`` (syncer.py): journaled records → the database in batches, the segments of a
  previous run replayed first at ``start()``, failed batches retried with backoff.
* the DB applier (applier.py): each batch written idempotently in one transaction, with the
  ``daily_spend`` aggregates.

A journal segment is deleted only once it is sealed and every record in it is committed
(``SegmentTracker``, segments.py). Money in the records is integer nano-USD.

Durability levels (``Durability``; ``await wait_durable(level)`` after ``record(...)``, or
``await record_durable(entry, level)``), from cheapest to safest:

* ``none``: ``record()`` alone returns before the record reaches the journal; a kill -9 within
  a few milliseconds can lose it.
* ``process`` (the chat path's default): resolves once the record's group was written with
  write(2). The bytes are then in the kernel's page cache, so a kill -9 (or any crash) of this
  process loses nothing; a power loss or kernel crash can lose what was written since the last
  fdatasync, i.e. at most about one sync interval of records (background fdatasyncs start at
  least 10 ms apart, ``SYNC_INTERVAL_S``; plus the one in progress, a few ms).
* ``fsync``: resolves only after the fdatasync that covers the record (survives power loss),
  at the cost of one fsync of latency (~4 ms on the development disk).

Failures are never swallowed (see the parts); ``health()`` reports them for /readyz. Must not
import web frameworks, the pipeline or the app.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from sqlalchemy.orm import Session, sessionmaker

from gateway.ledger.applier import write_batch
from gateway.ledger.entries import LedgerEntry, Record, RequestRecord
from gateway.ledger.journal import Journal, claim_writer_dir, release_journal_dir
from gateway.ledger.journal_writer import JournalWriter, LedgerError
from gateway.ledger.segments import SegmentTracker
from gateway.ledger.syncer import JournalSyncer

log = logging.getLogger("tiergate.ledger")

Durability = Literal["process", "fsync", "none"]
DURABILITY_LEVELS: tuple[Durability, ...] = ("process", "fsync", "none")

__all__ = ["DURABILITY_LEVELS", "Durability", "Ledger", "LedgerError", "LedgerHealth", "LedgerObserver"]


class LedgerObserver(Protocol):
    """Told of every record as it is recorded, and of every database batch
    (gateway.telemetry.metrics.LedgerMetrics). Must be cheap and must not raise."""

    def entry(self, e: LedgerEntry) -> None: ...
    def request(self, r: RequestRecord) -> None: ...
    def flush(self, seconds: float, records: int, pending_journal: int, pending_db: int) -> None: ...
    def flush_failed(self) -> None: ...


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


class Ledger:
    def __init__(self, session_factory: sessionmaker[Session], journal_dir: str | Path,
                 flush_interval_ms: int = 50, batch_size: int = 500, *,
                 max_segment_bytes: int = 16 * 1024 * 1024, max_segment_age_s: float = 10.0,
                 retry_max_s: float = 5.0) -> None:
        self._journal_root = Path(journal_dir)
        self._max_segment_bytes = max_segment_bytes
        self._max_segment_age_s = max_segment_age_s
        self._dir_lock: int | None = None
        self._journal_dir: Path | None = None
        self.segments = SegmentTracker(lambda seq: None)
        self.observer: LedgerObserver | None = None  # set by the runtime when metrics are on
        self._write_batch = functools.partial(write_batch, session_factory)
        self.syncer = JournalSyncer(self._apply, self.segments,
                                    batch_size=batch_size, flush_interval_ms=flush_interval_ms,
                                    retry_max_s=retry_max_s)
        self.writer = JournalWriter(self.segments, self.syncer.enqueue, self.syncer.journal_finished,
                                    retry_max_s=retry_max_s)
        self._started = False

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Replay journal segments left from a previous run (queued ahead of new records),
        then start the journal, sync and DB threads. Does not wait for the replay to commit."""
        if self._started:
            return
        own_dir, self._dir_lock = claim_writer_dir(self._journal_root)
        self._journal_dir = own_dir
        journal = Journal(own_dir, max_segment_bytes=self._max_segment_bytes,
                          max_segment_age_s=self._max_segment_age_s)
        self.segments.reset(journal.delete)
        replayed = self.syncer.replay(journal.existing_segments())
        self.writer.start(journal, replayed)
        self.syncer.start()
        self._started = True

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Journal everything buffered, then commit as much as possible within ``timeout_s``.
        Returns True when everything reached the database; otherwise what is left stays in
        the journal for the next start (and an error is logged)."""
        if not self._started:
            return True
        self._started = False
        deadline = time.monotonic() + timeout_s
        self.writer.request_stop()
        self.syncer.begin_stop()
        writer_gone = self.writer.join(deadline)
        syncer_gone = self.syncer.join(deadline)
        buffered, _, _ = self.writer.counts()
        pending, _ = self.syncer.counts()
        left = buffered + pending
        if left:
            log.error("ledger stopped with %d record(s) not committed; they stay in the journal", left)
        if self._dir_lock is not None and self._journal_dir is not None and writer_gone and syncer_gone:
            release_journal_dir(self._journal_root, self._journal_dir, self._dir_lock)
            self._dir_lock = None
        return left == 0

    async def astop(self, timeout_s: float = 10.0) -> bool:
        return await asyncio.to_thread(self.stop, timeout_s)

    def _apply(self, records: Sequence[Record]) -> object:
        """One database batch (the syncer's thread), timed for the observer."""
        observer = self.observer
        if observer is None:
            return self._write_batch(records)
        started = time.perf_counter()
        try:
            out = self._write_batch(records)
        except Exception:
            observer.flush_failed()
            raise
        seconds = time.perf_counter() - started
        buffered, _, _ = self.writer.counts()
        pending, _ = self.syncer.counts()
        observer.flush(seconds, len(records), buffered, max(pending - len(records), 0))
        return out

    # ---------------------------------------------------------------- recording
    def record(self, entry: LedgerEntry) -> None:
        """Queue one upstream call. Never blocks on I/O; raises LedgerError if not running."""
        self._append(entry, LedgerEntry)
        if self.observer is not None:
            self.observer.entry(entry)

    def record_request(self, rec: RequestRecord) -> None:
        """Queue a request record (upsert by id; a final status overwrites in_progress)."""
        self._append(rec, RequestRecord)
        if self.observer is not None:
            self.observer.request(rec)

    def _append(self, rec: Record, kind: type) -> None:
        if not isinstance(rec, kind):
            raise TypeError(f"expected {kind.__name__}, got {type(rec).__name__}")
        self.writer.append(rec)

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
        await self.writer.wait(level)

    def wait_durable_sync(self, timeout_s: float | None = None) -> bool:
        """Block until everything recorded so far is fdatasync'd in the journal."""
        return self.writer.wait_synced(timeout_s)

    def flush(self, timeout_s: float | None = 10.0) -> bool:
        """Block until everything recorded so far is committed to the database."""
        return self.syncer.wait_applied(self.writer.seq, timeout_s)

    async def aflush(self, timeout_s: float | None = 10.0) -> bool:
        return await asyncio.to_thread(self.flush, timeout_s)

    def health(self) -> LedgerHealth:
        buffered, written, synced = self.writer.counts()
        pending, committed = self.syncer.counts()
        w, s = self.writer, self.syncer
        failures = s.failures + w.journal_failures + w.sync_failures
        errors = [e for e in (w.last_error, s.last_error) if e is not None]
        return LedgerHealth(ok=failures == 0, running=w.running, pending_journal=buffered, pending_db=pending,
                            consecutive_failures=failures, last_error=max(errors)[1] if errors else None,
                            records_durable=synced, records_committed=committed, records_written=written)
