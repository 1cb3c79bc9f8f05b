"""``LineLedger``: the ledger sink of batch lines. It keeps each request's ledger rows and
request record in memory, by request id, until the line's result commits them to the database
in the same transaction (``gateway.jobs.store.finish_line``): a line's spend is in the ledger
exactly when its result is, so a worker that dies mid-line leaves neither, and its retry is
billed once. Thread-safe; imports the ledger's entry types only.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Literal

from gateway.ledger.entries import LedgerEntry, Record, RequestRecord


class LineLedger:
    def __init__(self) -> None:
        self._rows: defaultdict[str, list[Record]] = defaultdict(list)
        self._lock = threading.Lock()

    def record(self, entry: LedgerEntry) -> None:
        with self._lock:
            self._rows[entry.request_id].append(entry)

    def record_request(self, rec: RequestRecord) -> None:
        with self._lock:
            self._rows[rec.id].append(rec)

    async def wait_durable(self, level: Literal["process", "fsync", "none"] = "process") -> None:
        """Nothing to wait for: the line's database commit is what makes its rows durable."""

    def take(self, request_id: str) -> list[Record]:
        """The rows recorded for ``request_id`` so far, removed from the buffer."""
        with self._lock:
            return self._rows.pop(request_id, [])

    def pending(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._rows.values())
