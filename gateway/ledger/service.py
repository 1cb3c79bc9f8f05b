"""``Ledger``: lossless, non-blocking recording of every upstream call and every request.

A façade over three parts, each in its own module:

* ``JournalWriter`` (journal_writer.py): ``record()`` buffers; the event loop that recorded
  (or, where none runs, a journal thread) writes groups to the append-only journal (group
  commit), a sync thread fdatasyncs them; durability waits.
* ``JournalSyncer`` (syncer.py): journaled records → the database in batches, the segments of a
  previous run replayed first at ``start()``, failed batches retried with backoff.
* the DB applier (applier.py): each batch written idempotently in one transaction, with the
  ``daily_spend`` aggregates — on PostgreSQL in a child process by default (applier_process.py:
  the serving process's event loop then shares the GIL with no database work).

A journal segment is deleted only once it is sealed and every record in it is committed
(``SegmentTracker``, segments.py). Money in the records is integer nano-USD.

Intents: ``await begin(intent)`` journals a ``CallIntent`` before an upstream call (written with
write(2) when it returns; refused at once while journal writes fail); the call's ``LedgerEntry``
(same id) supersedes it. Each ledger holds an owner lock (owners.py); ``start()`` settles the
open intents of owners whose process died as ``interrupted`` rows (interrupted.py), after the
replayed journal is committed, on its own thread (``wait_settled``).

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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from sqlalchemy.orm import Session, sessionmaker

from gateway.ledger.applier import write_batch
from gateway.ledger.applier_process import ProcessApplier
from gateway.ledger.entries import CallIntent, IntentVoid, LedgerEntry, Record, RequestRecord
from gateway.ledger.interrupted import settle_owners
from gateway.ledger.journal import Journal, claim_writer_dir, release_journal_dir
from gateway.ledger.journal_writer import JournalWriter, LedgerError
from gateway.ledger.owners import claim_owner, lock_dead_owners, release_owner
from gateway.ledger.segments import SegmentTracker
from gateway.ledger.syncer import JournalSyncer

log = logging.getLogger("tiergate.ledger")

Durability = Literal["process", "fsync", "none"]
ApplierMode = Literal["auto", "thread", "process"]
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
    open_intents: int = 0         # upstream calls started and not finished (their intents journaled)
    owners_to_settle: int = 0     # dead processes whose interrupted calls are not settled yet
    interrupted_settled: int = 0  # interrupted rows this process wrote for dead processes
    journal_ok: bool = True       # the journal takes writes (and syncs): new calls can be recorded


def _process_applier(session_factory: sessionmaker[Session], mode: ApplierMode, nice: int) -> ProcessApplier | None:
    """The child-process applier where ``mode`` asks for it (``auto``: on PostgreSQL), else None
    (batches are written on the DB thread)."""
    if mode == "thread":
        return None
    bind = getattr(session_factory, "kw", {}).get("bind")  # a sessionmaker's engine (tests may pass a plain callable)
    dialect = getattr(getattr(bind, "dialect", None), "name", None)
    if dialect != "postgresql":
        if mode == "process":
            raise ValueError(f"ledger.applier: process needs PostgreSQL (the database is {dialect or 'unknown'})")
        return None
    assert bind is not None
    return ProcessApplier(bind.url.render_as_string(hide_password=False),
                          {"pool_size": 1, "max_overflow": 0, "pool_pre_ping": True}, nice=nice)


class Ledger:
    def __init__(self, session_factory: sessionmaker[Session], journal_dir: str | Path,
                 flush_interval_ms: int = 200, batch_size: int = 500, *,
                 max_segment_bytes: int = 16 * 1024 * 1024, max_segment_age_s: float = 10.0,
                 retry_max_s: float = 5.0, interrupted_billing: Literal["estimate", "reserved"] = "estimate",
                 applier: ApplierMode = "auto", applier_nice: int = 10) -> None:
        self._journal_root = Path(journal_dir)
        self._session_factory = session_factory
        self._retry_max_s = retry_max_s
        self.interrupted_billing: Literal["estimate", "reserved"] = interrupted_billing
        self.owner = ""
        self._owner_fd: int | None = None
        self._dead_owners: dict[str, int] = {}
        self._open_intents: set[str] = set()
        self._settled = threading.Event()
        self._settle_stop = threading.Event()
        self._settle_thread: threading.Thread | None = None
        self._settle_error: tuple[float, str] | None = None
        self.interrupted_settled = 0
        self._max_segment_bytes = max_segment_bytes
        self._max_segment_age_s = max_segment_age_s
        self._dir_lock: int | None = None
        self._journal_dir: Path | None = None
        self.segments = SegmentTracker(lambda seq: None)
        self.observer: LedgerObserver | None = None  # set by the runtime when metrics are on
        self.process_applier = _process_applier(session_factory, applier, applier_nice)
        self._write_batch = self.process_applier or functools.partial(write_batch, session_factory)
        self.syncer = JournalSyncer(self._apply, self.segments,
                                    batch_size=batch_size, flush_interval_ms=flush_interval_ms,
                                    retry_max_s=retry_max_s,
                                    apply_lines=self._apply_lines if self.process_applier is not None else None)
        self.writer = JournalWriter(self.segments, self.syncer.enqueue, self.syncer.journal_finished,
                                    retry_max_s=retry_max_s)
        self._started = False

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Replay journal segments left from a previous run (queued ahead of new records),
        then start the journal, sync and DB threads. Does not wait for the replay to commit."""
        if self._started:
            return
        self.owner, self._owner_fd = claim_owner(self._journal_root)
        # Dead owners are locked before their journal segments are adopted: their intents are
        # settled after every row those segments hold is committed.
        self._dead_owners = lock_dead_owners(self._journal_root, self.owner)
        own_dir, self._dir_lock = claim_writer_dir(self._journal_root)
        self._journal_dir = own_dir
        journal = Journal(own_dir, max_segment_bytes=self._max_segment_bytes,
                          max_segment_age_s=self._max_segment_age_s)
        self.segments.reset(journal.delete)
        replayed = self.syncer.replay(journal.existing_segments())
        self.writer.start(journal, replayed)
        self.syncer.start()
        self._started = True
        self._settled.clear()
        self._settle_stop.clear()
        self._settle_thread = threading.Thread(target=self._settle_dead, args=(replayed,), name="ledger-settle",
                                               daemon=True)
        self._settle_thread.start()

    def _settle_dead(self, replayed: int) -> None:
        """Once the replayed journal is committed, settle the dead owners' open intents as
        ``interrupted`` rows (retried with backoff while the database fails)."""
        failures = 0
        try:
            while self._dead_owners and not self._settle_stop.is_set():
                if not self.syncer.wait_applied(replayed, 0.5):
                    continue
                try:
                    n = settle_owners(self._session_factory, list(self._dead_owners), self.interrupted_billing)
                except Exception as exc:
                    failures += 1
                    self._settle_error = (time.monotonic(), f"settling interrupted calls: {type(exc).__name__}")
                    log.error("ledger: settling interrupted calls failed (attempt %d), retrying", failures,
                              exc_info=exc)
                    self._settle_stop.wait(min(0.05 * 2 ** (failures - 1), self._retry_max_s))
                    continue
                self._settle_error = None
                self.interrupted_settled += n
                if n:
                    log.warning("ledger: %d upstream call(s) of %d stopped process(es) settled as interrupted "
                                "(%s)", n, len(self._dead_owners), self.interrupted_billing)
                for owner, fd in self._dead_owners.items():
                    release_owner(self._journal_root, owner, fd, remove=True)
                self._dead_owners = {}
        finally:
            self._settled.set()

    def wait_settled(self, timeout_s: float | None = None) -> bool:
        """Block until the intents of dead processes are settled (True), or ``timeout_s`` passed."""
        return self._settled.wait(timeout_s)

    async def await_settled(self, timeout_s: float | None = 10.0) -> bool:
        return await asyncio.to_thread(self.wait_settled, timeout_s)

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
        if self.process_applier is not None:
            self.process_applier.close(max(deadline - time.monotonic(), 1.0))
        if self._dir_lock is not None and self._journal_dir is not None and writer_gone and syncer_gone:
            release_journal_dir(self._journal_root, self._journal_dir, self._dir_lock)
            self._dir_lock = None
        self._settle_stop.set()
        if self._settle_thread is not None:
            self._settle_thread.join(max(deadline - time.monotonic(), 0.1))
        for owner, fd in self._dead_owners.items():  # not settled: left for the next start
            release_owner(self._journal_root, owner, fd, remove=False)
        self._dead_owners = {}
        if self._owner_fd is not None:
            if self._open_intents:
                log.error("ledger stopped with %d upstream call(s) unfinished; the next start settles them as "
                          "interrupted", len(self._open_intents))
            release_owner(self._journal_root, self.owner, self._owner_fd,
                          remove=not self._open_intents and left == 0 and writer_gone)
            self._owner_fd = None
        return left == 0

    async def astop(self, timeout_s: float = 10.0) -> bool:
        return await asyncio.to_thread(self.stop, timeout_s)

    def _apply(self, records: Sequence[Record]) -> object:
        """One database batch (the syncer's thread), timed for the observer."""
        return self._timed(functools.partial(self._write_batch, records), len(records))

    def _apply_lines(self, lines: bytes, count: int) -> object:
        """One database batch given as its journal lines (the child-process applier's way)."""
        assert self.process_applier is not None
        return self._timed(functools.partial(self.process_applier.apply_lines, lines, count), count)

    def _timed(self, write: Callable[[], object], count: int) -> object:
        observer = self.observer
        if observer is None:
            return write()
        started = time.perf_counter()
        try:
            out = write()
        except Exception:
            observer.flush_failed()
            raise
        seconds = time.perf_counter() - started
        buffered, _, _ = self.writer.counts()
        pending, _ = self.syncer.counts()
        observer.flush(seconds, count, buffered, max(pending - count, 0))
        return out

    # ---------------------------------------------------------------- recording
    def record(self, entry: LedgerEntry) -> None:
        """Queue one upstream call. Never blocks on I/O; raises LedgerError if not running."""
        self._append(entry, LedgerEntry)
        if self.observer is not None:
            self.observer.entry(entry)
        self._open_intents.discard(entry.id)

    async def begin(self, intent: CallIntent) -> None:
        """Journal ``intent`` (stamped with this process as its owner) and return once it is
        written with write(2): from then on a kill -9 of this process cannot lose the call. Call
        before the call's first byte goes upstream; its ``LedgerEntry`` (same id) finishes it.
        Raises ``LedgerError`` when the journal cannot take it — at once while its writes are
        failing (a full disk): then do not make the call (the intent is voided, nothing is
        billed). Calls are taken again once a retried write succeeds (within ``retry_max_s``)."""
        if not self._started:
            raise LedgerError("ledger is not running")
        if self.writer.journal_failures:  # failing (e.g. the disk is full): refuse at once, start nothing
            raise LedgerError(f"ledger journal is not writable ({self.writer.journal_failures} failed write(s), "
                              "retrying)")
        if not isinstance(intent, CallIntent):
            raise TypeError(f"expected CallIntent, got {type(intent).__name__}")
        owned = object.__new__(CallIntent)  # a copy stamped with the owner (copy.copy: ~6 us, replace: ~10)
        owned.__dict__.update(intent.__dict__, owner=self.owner)
        self._open_intents.add(intent.id)
        try:
            if not self.writer.append_written(owned):  # written here and now, or left to the journal thread
                await self.writer.wait("process")
        except BaseException:  # failed or cancelled: the call is not made
            self.void(intent.id)
            raise

    def void(self, call_id: str) -> None:
        """The call of intent ``call_id`` was never made: drop its intent (bills nothing)."""
        self._open_intents.discard(call_id)
        self.writer.append(IntentVoid(call_id))

    def record_request(self, rec: RequestRecord) -> None:
        """Queue a request record (upsert by id; a final status overwrites in_progress)."""
        self._append(rec, RequestRecord)
        if self.observer is not None:
            self.observer.request(rec)

    @property
    def open_intents(self) -> int:
        return len(self._open_intents)

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
        return self.syncer.wait_applied(self.writer.seq, timeout_s, urge=True)

    async def aflush(self, timeout_s: float | None = 10.0) -> bool:
        return await asyncio.to_thread(self.flush, timeout_s)

    def health(self) -> LedgerHealth:
        buffered, written, synced = self.writer.counts()
        pending, committed = self.syncer.counts()
        w, s = self.writer, self.syncer
        failures = s.failures + w.journal_failures + w.sync_failures
        errors = [e for e in (w.last_error, s.last_error, self._settle_error) if e is not None]
        return LedgerHealth(ok=failures == 0, running=w.running, pending_journal=buffered, pending_db=pending,
                            consecutive_failures=failures, last_error=max(errors)[1] if errors else None,
                            records_durable=synced, records_committed=committed, records_written=written,
                            open_intents=len(self._open_intents), owners_to_settle=len(self._dead_owners),
                            interrupted_settled=self.interrupted_settled,
                            journal_ok=w.running and w.journal_failures == 0 and w.sync_failures == 0)
