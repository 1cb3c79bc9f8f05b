"""The journal writer's *sync thread* (``SyncThread``, a part of ``JournalWriter``): fdatasyncs
what the writer has written and resolves the ``fsync`` waiters it covered; fdatasyncs nobody waits
for start at least the writer's sync interval apart. The state it reads and sets is the writer's
(one lock, see journal_writer.py). Imports ledger.journal and waiters only."""

from __future__ import annotations

import logging
import threading
import time

from gateway.ledger.journal import Journal
from gateway.ledger.waiters import LedgerError, Waiter, resolve_waiter, take_waiters

log = logging.getLogger("tiergate.ledger")


class SyncThread:
    """The sync thread's half of ``JournalWriter`` (whose ``__init__`` sets all of this)."""

    journal: Journal | None
    _lock: threading.Lock
    _cond: threading.Condition
    _to_sync: threading.Condition
    _sync_interval_s: float
    _sync_idle: bool
    _written_seq: int
    _synced_seq: int
    _synced_waiters: list[Waiter]
    _blocking_sync_waits: int
    _exited: bool
    _reseal: bool
    _retry_max_s: float
    sync_failures: int
    last_error: tuple[float, str] | None

    def _sync_loop(self) -> None:
        """fdatasync whatever has been written; exits after the journal thread. Unless someone
        waits for a sync (an ``fsync`` waiter, ``wait_synced``) or the journal thread has exited,
        syncs start at least ``sync_interval_s`` apart: one fdatasync costs ~0.1 ms of CPU in
        this thread plus its wakeups and GIL handoffs, and back to back they ran about once per
        request at low concurrency."""
        journal = self._journal_()
        last_start = -self._sync_interval_s
        while True:
            with self._lock:
                while True:
                    early = last_start + self._sync_interval_s - time.monotonic()
                    if self._synced_seq >= self._written_seq:
                        if self._exited:
                            return  # journal thread gone, everything synced (its last seal synced too)
                        if early > 0:  # synced lately: look again when the interval is over, so that
                            self._to_sync.wait(timeout=early)  # under load nobody has to wake this thread
                            continue
                        self._sync_idle = True
                        self._to_sync.wait(timeout=1.0)
                        self._sync_idle = False
                        continue
                    if early <= 0 or self._exited or self._synced_waiters or self._blocking_sync_waits:
                        break
                    self._to_sync.wait(timeout=early)
                target = self._written_seq
            last_start = time.monotonic()
            try:
                journal.sync()  # covers every write that returned before target was read
            except OSError as exc:
                self._sync_failed(target, exc)
                continue
            with self._lock:
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
        with self._lock:
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
