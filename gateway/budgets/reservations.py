"""``ReservationStore``: embedded-mode persistence of budget holds (``budget_reservations``).

A hold is written before its upstream call (so a process that dies leaves holds that expire
after their lease instead of vanishing or living forever); how it ended (settled with its
nano-USD, or released) is written in batches afterwards. Must not import routes, the app,
the pipeline or providers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from gateway.budgets.holds import Hold
from gateway.db.models import BudgetReservationRow
from gateway.log_safety import describe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldRow:
    """A persisted, still-open hold (after a restart: another incarnation's)."""

    id: str
    counter_keys: tuple[str, ...]
    amount_nanos: int
    expires_at: datetime


class ReservationStore:
    """Embedded-mode persistence of reservations.

    ``insert`` is awaited before the upstream call (the hold is durable); settle/release
    outcomes are queued and written in batches by a background task, retried until they
    succeed (a write that never lands leaves a ``held`` row that expires after its lease,
    which errs on the side of the tenant's budget, never against it).
    """

    def __init__(self, session_factory: sessionmaker[Session], *, batch_interval_s: float = 0.05) -> None:
        self._sf = session_factory
        self._interval = batch_interval_s
        self._pending: list[tuple[str, str, int | None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Inserts still being written: an outcome is never written before its hold's row (a request
        # cancelled while its insert runs in a thread would otherwise leave the row 'held').
        self._inserting: dict[str, asyncio.Future[None]] = {}

    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.create_task(self._writer(), name="budget-reservation-writer")

    async def stop(self) -> None:
        """Write every queued outcome, then stop the writer."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        batch = self._take()
        await self._inserted(batch)
        await asyncio.to_thread(self._write_outcomes, batch)

    async def insert(self, res: Hold) -> None:
        row = BudgetReservationRow(
            id=res.id, tenant_id=res.tenant_id, key_id=res.key_id, request_id=res.request_id,
            counters=[c.key for c in res.counters], amount_nanos=res.amount_nanos, status="held",
            created_at=res.created_at, expires_at=res.expires_at)
        written = asyncio.ensure_future(asyncio.to_thread(self._insert, row))
        self._inserting[res.id] = written
        written.add_done_callback(lambda _: self._inserting.pop(res.id, None))
        await asyncio.shield(written)

    async def _inserted(self, batch: Sequence[tuple[str, str, int | None]]) -> None:
        """Wait until the rows ``batch``'s outcomes update are written (their inserts' errors are
        their callers')."""
        waiting = [self._inserting[rid] for rid, _, _ in batch if rid in self._inserting]
        if waiting:
            await asyncio.gather(*waiting, return_exceptions=True)

    def _insert(self, row: BudgetReservationRow) -> None:
        with self._sf.begin() as session:
            session.add(row)

    def finish(self, reservation_id: str, status: str, settled_nanos: int | None) -> None:
        """Queue how a hold ended (settled | released); never blocks."""
        self._pending.append((reservation_id, status, settled_nanos))
        self._wake.set()

    def _take(self) -> list[tuple[str, str, int | None]]:
        batch, self._pending = self._pending, []
        return batch

    async def _writer(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            if not self._stopping:
                await asyncio.sleep(self._interval)
            batch = self._take()
            try:
                await self._inserted(batch)
                await asyncio.to_thread(self._write_outcomes, batch)
            except Exception as err:
                log.error("writing %d reservation outcomes failed; retrying: %s", len(batch), describe(err))
                self._pending[:0] = batch
                if self._stopping:
                    raise
                await asyncio.sleep(1.0)
                self._wake.set()

    def _write_outcomes(self, batch: Sequence[tuple[str, str, int | None]]) -> None:
        if not batch:
            return
        with self._sf.begin() as session:
            for rid, status, settled in batch:
                session.execute(update(BudgetReservationRow)
                                .where(BudgetReservationRow.id == rid, BudgetReservationRow.status == "held")
                                .values(status=status, settled_nanos=settled))

    async def load_held(self, now: datetime) -> list[HeldRow]:
        """Mark expired holds ``expired`` and return the still-leased ones."""
        return await asyncio.to_thread(self._load_held, now)

    def _load_held(self, now: datetime) -> list[HeldRow]:
        with self._sf.begin() as session:
            session.execute(update(BudgetReservationRow)
                            .where(BudgetReservationRow.status == "held",
                                   BudgetReservationRow.expires_at <= now)
                            .values(status="expired"))
            rows = session.scalars(select(BudgetReservationRow)
                                   .where(BudgetReservationRow.status == "held")).all()
            return [HeldRow(r.id, tuple(r.counters), r.amount_nanos, _aware(r.expires_at)) for r in rows]

    async def expire(self, ids: Sequence[str]) -> None:
        if ids:
            await asyncio.to_thread(self._write_outcomes, [(i, "expired", None) for i in ids])


def _aware(ts: datetime) -> datetime:
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)
