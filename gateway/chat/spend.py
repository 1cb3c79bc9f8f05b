"""What executing a chat request returns: its ``Spend`` (usage and nano-USD over its upstream
calls), a ``Completion`` (the answer and its spend) or a ``SpendStream`` (chunks, then the spend
once the stream has ended or was closed), and the ``CallSink`` every upstream call's ledger row is
handed to as the call ends.

The stream contract, for every stream the chat path passes around: iterate it, and always
``aclose()`` it (idempotent; on a stream that has not ended it cancels the upstream call, which
stops generating); after ``aclose()`` — or after the last chunk — ``spend`` covers every upstream
call the stream made, billed.

Imports the ledger's plain data (and its ``LedgerError``), errors and the provider contract only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.errors import ServiceUnavailable
from gateway.ledger.entries import CallIntent, LedgerEntry
from gateway.ledger.journal_writer import LedgerError
from gateway.providers.base import Usage


@dataclass(frozen=True)
class Spend:
    """Usage and cost summed over some upstream calls (nano-USD; baseline: the same tokens on the
    high tier, for the saving)."""

    usage: Usage = field(default_factory=Usage)
    cost_nanos: int = 0
    baseline_nanos: int = 0
    calls: int = 0
    model: str | None = None  # the model of the latest call

    def __add__(self, other: Spend) -> Spend:
        if self is NOTHING and (other.model or other.model is None):
            return other  # the sum would equal it field by field (both are immutable)
        return Spend(self.usage + other.usage, self.cost_nanos + other.cost_nanos,
                     self.baseline_nanos + other.baseline_nanos, self.calls + other.calls,
                     other.model or self.model)

    @classmethod
    def of(cls, entry: LedgerEntry) -> Spend:
        return cls(entry.usage, entry.cost_nanos, entry.baseline_cost_nanos, 1, entry.model)


NOTHING = Spend()


class CallSink(Protocol):
    """Where an executor journals each upstream call's intent before the call (``begin``) and
    hands its ledger row (the same id) as the call ends (``record``)."""

    def record(self, entry: LedgerEntry) -> None: ...

    async def begin(self, intent: CallIntent) -> None: ...


class IntentLedger(Protocol):
    def record(self, entry: LedgerEntry) -> None: ...

    async def begin(self, intent: CallIntent) -> None: ...


async def begin_call(ledger: IntentLedger, intent: CallIntent) -> None:
    """``ledger.begin(intent)``; a journal that cannot take it refuses the call with a 503
    (nothing was sent upstream, nothing is billed)."""
    try:
        await ledger.begin(intent)
    except LedgerError as exc:
        raise ServiceUnavailable("The gateway cannot record spend right now (its ledger journal is not "
                                 "writable); no upstream call was made. Retry later.", retry_after_s=5) from exc


@dataclass(frozen=True)
class Completion:
    response: dict[str, Any]
    spend: Spend


class SpendStream(Protocol):
    """Chunks of one streamed answer; see the module docstring for the close contract."""

    def __aiter__(self) -> SpendStream: ...

    async def __anext__(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...

    @property
    def spend(self) -> Spend: ...


class RequestRows:
    """The ``CallSink`` of one request: every upstream call's row passes through it and is summed
    into ``spend`` — what the budgets settle on and the request record reports, whatever happened
    to the request. With ``park`` the rows wait (``take_parked``) so that the request's record and
    its rows go to the journal in one write and one fsync (a direct request: its one call ends
    just before the request does); otherwise each row goes to the ledger as its call ends."""

    def __init__(self, ledger: IntentLedger, *, park: bool) -> None:
        self._ledger = ledger
        self._parked: list[LedgerEntry] | None = [] if park else None
        self.spend = NOTHING

    def record(self, entry: LedgerEntry) -> None:
        self.spend = self.spend + Spend.of(entry)
        if self._parked is not None:
            self._parked.append(entry)
        else:
            self._ledger.record(entry)  # never swallowed: the money path fails loudly

    async def begin(self, intent: CallIntent) -> None:
        """Journal the call's intent now, never parked: it must be written before the call."""
        await begin_call(self._ledger, intent)

    def take_parked(self) -> list[LedgerEntry]:
        """The parked rows, and stop parking (later rows go to the ledger at once)."""
        rows, self._parked = self._parked or [], None
        return rows
