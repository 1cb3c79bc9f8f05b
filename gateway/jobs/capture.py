"""``AttemptLedger``: the ledger sink of batch line attempts. Each upstream call's ledger row
goes straight to the real ledger (its append-only journal, then the database), as a live
request's does, so a worker killed after a call answered still bills that call: the restart
replays the journal (idempotent on the row's id). The attempt's *request record* is held
here, by request id, until the line's fenced commit (``gateway.jobs.store.finish_line`` /
``release_line``) has decided whether the attempt owns the line: it is then written once, with
its final status (ok / error / superseded), in that commit's transaction.

``wait_durable`` never waits for less than ``process`` (rows written to the journal): a batch
line's rows must survive a kill -9 before its result commits, whatever ``ledger.durability``
says for live answers. Thread-safe; imports the ledger's entry types and chat.spend's
``begin_call`` only.
"""

from __future__ import annotations

import threading
from typing import Literal, Protocol

from gateway.chat.spend import begin_call
from gateway.ledger.entries import CallIntent, LedgerEntry, RequestRecord


class JournaledLedger(Protocol):
    """What ``AttemptLedger`` needs of the real ledger (``gateway.ledger.Ledger``)."""

    def record(self, entry: LedgerEntry) -> None: ...
    async def begin(self, intent: CallIntent) -> None: ...
    async def wait_durable(self, level: Literal["process", "fsync", "none"] = ...) -> None: ...


class AttemptLedger:
    def __init__(self, ledger: JournaledLedger) -> None:
        self._ledger = ledger
        self._requests: dict[str, RequestRecord] = {}
        self._lock = threading.Lock()

    def record(self, entry: LedgerEntry) -> None:
        """One upstream call's row: to the ledger now (raises if the ledger cannot take it)."""
        self._ledger.record(entry)

    async def begin(self, intent: CallIntent) -> None:
        """One upstream call's intent: journaled (written) before the call is made."""
        await begin_call(self._ledger, intent)

    def record_request(self, rec: RequestRecord) -> None:
        with self._lock:
            self._requests[rec.id] = rec

    async def wait_durable(self, level: Literal["process", "fsync", "none"] = "process") -> None:
        """Every row recorded so far is in the journal (``fsync``: and fdatasync'd); raises
        ``LedgerError`` when the journal write failed."""
        await self._ledger.wait_durable("fsync" if level == "fsync" else "process")

    def take_request(self, request_id: str) -> RequestRecord | None:
        """The request record of ``request_id`` (None if the flow wrote none), removed."""
        with self._lock:
            return self._requests.pop(request_id, None)

    def pending(self) -> int:
        with self._lock:
            return len(self._requests)
