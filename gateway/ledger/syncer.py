"""``JournalSyncer``: the ledger's way from the journal to the database.

Journaled groups (``enqueue``, from the journal writer) and, at start, the records of segments
a previous run left behind (``replay``, queued ahead of everything new) wait in a queue. The
*DB thread* takes them in batches (``batch_size`` records, or whatever is queued after
``flush_interval_ms``, or at once while stopping or while someone waits for them:
``wait_applied(urge=True)``, which ``Ledger.flush`` uses) and hands each batch to the applier
(``apply``: idempotent, one transaction, see applier.py), so a record applied twice — a replay
after a crash that followed the commit — is never counted twice. A batch is taken off the queue
only after it committed; then its segments are told (``SegmentTracker.applied``) so they can be
deleted. A failed batch is logged, kept (queue and journal) and retried with exponential
backoff up to ``retry_max_s``; it shows in ``failures`` / ``last_error`` for /readyz. Known
limit: during a long database outage the pending records are also held in memory.
Imports ledger.entries, journal (reading segments) and segments only; the database is
reached only through ``apply``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.ledger.entries import Record
from gateway.ledger.journal import encode_lines, read_segment
from gateway.ledger.segments import SegmentTracker
from gateway.log_safety import describe

log = logging.getLogger("tiergate.ledger")

Apply = Callable[[Sequence[Record]], object]  # writes one batch in one transaction, or raises
# ``Apply`` for a batch given as its journal lines (journal.encode_lines) and its record count
ApplyLines = Callable[[bytes, int], object]


@dataclass
class _Group:
    segment: int
    records: list[Record]  # empty where the syncer keeps the group's journal lines instead
    upto_seq: int  # the sequence number of its last record
    count: int
    lines: bytes = b""


class JournalSyncer:
    def __init__(self, apply: Apply, segments: SegmentTracker, *, batch_size: int = 500,
                 flush_interval_ms: int = 50, retry_max_s: float = 5.0,
                 apply_lines: ApplyLines | None = None) -> None:
        self._apply = apply
        # Where given, batches go to ``apply_lines`` as the journal lines the writer already
        # encoded (the process applier sends them to its child as they are: nothing is pickled
        # here, on a thread that shares the GIL with the event loop), and the queue keeps only
        # those bytes, not the records.
        self._apply_lines = apply_lines
        self._segments = segments
        self._batch_size = batch_size
        self._flush_s = flush_interval_ms / 1000
        self._retry_max_s = retry_max_s
        self._cond = threading.Condition()  # queue, applied seq, flags
        self._queue: deque[_Group] = deque()
        self._queued = 0  # records in the queue
        self._applied_seq = 0
        self._journal_done = False
        self._stopping = False
        self._abandon = False
        self._urgent_seq = 0  # someone waits for the records up to here: written without waiting out the interval
        self.failures = 0
        self.last_error: tuple[float, str] | None = None  # (monotonic time, message)
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle
    def replay(self, segment_paths: Sequence[Path]) -> int:
        """Queue the records of segments left by an earlier run (oldest first), numbered from 1;
        returns how many. Call before ``start`` (the replay is committed by the DB thread)."""
        with self._cond:
            self._queue.clear()
            self._queued = 0
            self._applied_seq = 0
            self._urgent_seq = 0
        seq = 0
        for path in segment_paths:
            contents = read_segment(path)
            if contents.skipped_lines:
                log.warning("ledger journal %s: skipped %d torn or corrupt line(s)", path, contents.skipped_lines)
            self._segments.replayed(contents.seq, len(contents.records))
            for i in range(0, len(contents.records), self._batch_size):
                chunk = contents.records[i:i + self._batch_size]
                seq += len(chunk)
                self._queue.append(self._group(contents.seq, chunk, seq, None))
                self._queued += len(chunk)
        if seq:
            log.info("ledger: replaying %d journaled record(s)", seq)
        return seq

    def start(self) -> None:
        with self._cond:
            self._journal_done = self._stopping = self._abandon = False
        self._thread = threading.Thread(target=self._run, name="ledger-db", daemon=True)
        self._thread.start()

    def begin_stop(self) -> None:
        """Stop waiting for full batches: write whatever is queued at once."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def journal_finished(self) -> None:
        """Nothing more will be enqueued: exit once the queue is empty."""
        with self._cond:
            self._journal_done = True
            self._cond.notify_all()

    def join(self, deadline: float) -> bool:
        """Wait until ``deadline`` (monotonic) for the queue to drain; past it, abandon the
        batch being retried (it stays in the journal). True when the DB thread is gone."""
        if self._thread is None:
            return True
        self._thread.join(max(deadline - time.monotonic(), 0.1))
        if self._thread.is_alive():
            with self._cond:
                self._abandon = True
                self._cond.notify_all()
            self._thread.join(self._retry_max_s + 1)
        return not self._thread.is_alive()

    # ---------------------------------------------------------------- the journal writer's side
    def enqueue(self, segment: int, records: list[Record], upto_seq: int, lines: bytes | None = None) -> None:
        """A journaled group (``lines``: as the journal holds it, if known), for the database.
        Wakes the DB thread only when it has to act: the queue was empty (it waits for a first
        group) or a batch is full (otherwise it is already waiting for the flush interval to
        pass, or writing)."""
        group = self._group(segment, records, upto_seq, lines)
        with self._cond:
            was_empty = not self._queue
            self._queue.append(group)
            self._queued += len(records)
            if was_empty or self._queued >= self._batch_size:
                self._cond.notify_all()

    def _group(self, segment: int, records: list[Record], upto_seq: int, lines: bytes | None) -> _Group:
        if self._apply_lines is None:
            return _Group(segment, records, upto_seq, len(records))
        return _Group(segment, [], upto_seq, len(records), encode_lines(records) if lines is None else lines)

    # ---------------------------------------------------------------- observing
    def wait_applied(self, target_seq: int, timeout_s: float | None, *, urge: bool = False) -> bool:
        """Block until every record up to ``target_seq`` is committed. ``urge``: the DB thread
        writes them as soon as they are queued, not after the flush interval (a caller waiting
        for them, e.g. ``Ledger.flush``, never waits out the interval)."""
        with self._cond:
            if urge and target_seq > self._urgent_seq:
                self._urgent_seq = target_seq
                self._cond.notify_all()
            return self._cond.wait_for(lambda: self._applied_seq >= target_seq, timeout_s)

    def counts(self) -> tuple[int, int]:
        """(records waiting for the database, last sequence number committed)."""
        with self._cond:
            return self._queued, self._applied_seq

    # ---------------------------------------------------------------- DB thread
    def _take(self) -> list[_Group] | None:
        """Wait for a batch worth writing; None means: exit."""
        with self._cond:
            deadline = time.monotonic() + self._flush_s
            while True:
                queued = self._queued
                if self._abandon or (self._journal_done and not queued):
                    return None
                if queued and (queued >= self._batch_size or self._stopping or self._urgent_seq > self._applied_seq
                               or time.monotonic() >= deadline):
                    break
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.001) if queued else 1.0)
            groups: list[_Group] = []
            n = 0
            for group in self._queue:
                if groups and n + group.count > self._batch_size:
                    break
                groups.append(group)
                n += group.count
            return groups

    def _run(self) -> None:
        while True:
            groups = self._take()
            if groups is None:
                return
            try:
                if self._apply_lines is not None:
                    self._apply_lines(b"".join(g.lines for g in groups), sum(g.count for g in groups))
                else:
                    self._apply([r for g in groups for r in g.records])
            except Exception as exc:
                self._failed(len(groups), exc)
                continue
            with self._cond:
                for group in groups:
                    self._queue.popleft()
                    self._queued -= group.count
                self.failures = 0
                self._applied_seq = max(self._applied_seq, groups[-1].upto_seq)
                self._cond.notify_all()
            for group in groups:
                self._segments.applied(group.segment, group.count)

    def _failed(self, n_groups: int, exc: Exception) -> None:
        with self._cond:
            self.failures += 1
            self.last_error = (time.monotonic(), f"database: {type(exc).__name__}: {exc}"[:500])
            delay = min(0.05 * 2 ** (self.failures - 1), self._retry_max_s)
            log.error("ledger DB write failed (attempt %d, %d batch(es) kept in the journal, retry in %.2fs): %s",
                      self.failures, n_groups, delay, describe(exc))
            self._cond.wait_for(lambda: self._abandon, timeout=delay)
