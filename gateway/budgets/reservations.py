"""Reservations: the worst-case hold taken on budget counters before an upstream call.

Money is counted in integer nano-dollars (1e-9 USD, the ledger's Numeric(18,9) scale) so
counters in memory, in Redis (Lua numbers) and in SQL agree to the last digit.
``ReservationStore`` persists embedded-mode reservations so that a process that dies
leaves holds that expire after their lease instead of vanishing or living forever.
Must not import routes, the app, the pipeline or providers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from gateway.budgets.periods import PeriodWindow
from gateway.db.models import BudgetReservationRow
from gateway.log_safety import describe
from gateway.settings import Price, Settings

log = logging.getLogger(__name__)
NANOS_PER_USD = 10**9


def to_nanos(usd: float | Decimal | int) -> int:
    """USD → integer nano-dollars, rounded half-up exactly like Numeric(18,9) storage."""
    return int((Decimal(str(usd)) * NANOS_PER_USD).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def from_nanos(nanos: int) -> float:
    return nanos / NANOS_PER_USD


def worst_case_cost(settings: Settings, tier: str, model: str | None, prompt_tokens: int,
                    max_tokens: int | None, *, price: Price | None = None) -> float:
    """Worst-case USD of one upstream call: prompt × input price + max output × output price.

    ``model`` is the upstream model actually called (a fallback can be dearer than the
    tier's own model); ``max_tokens`` is what the call may generate (the client's
    max_tokens), defaulting to the tier's ``max_output_tokens``. ``price`` overrides the
    configured price (e.g. litellm's price map). Cached-input discounts are ignored.
    """
    tier_settings = settings.tiers.get(tier)  # type: ignore[call-overload]
    if price is None:
        if tier_settings is not None and (model is None or model == tier_settings.model or tier_settings.price):
            price = settings.tier_price(tier)
        else:
            price = settings.models[model].price if model is not None else Price()
    default_out = tier_settings.max_output_tokens if tier_settings is not None else 0
    if max_tokens is None and model is not None and tier_settings is None:
        default_out = settings.models[model].context_window
    out_tokens = default_out if max_tokens is None else max_tokens
    return (max(prompt_tokens, 0) * price.input + max(out_tokens, 0) * price.output) / 1e6


@dataclass(frozen=True)
class CounterRef:
    """One budget counter a reservation holds against: a subject in one period window."""

    subject: str  # "tenant:<id>" | "key:<id>"
    scope: str  # "tenant" | "key"
    tenant_id: str
    key_id: str | None
    window: PeriodWindow
    limit_nanos: int

    @property
    def key(self) -> str:
        return f"{self.subject}|{self.window.key}"


@dataclass(frozen=True)
class Reservation:
    id: str
    tenant_id: str
    key_id: str | None
    request_id: str | None
    counters: tuple[CounterRef, ...]
    amount_nanos: int
    created_at: datetime
    expires_at: datetime
    remaining_nanos: int | None = None  # tightest remaining budget right after reserving

    @property
    def amount_usd(self) -> float:
        return from_nanos(self.amount_nanos)

    @property
    def remaining_usd(self) -> float | None:
        return None if self.remaining_nanos is None else from_nanos(self.remaining_nanos)


@dataclass(frozen=True)
class HeldRow:
    """A persisted, still-held reservation (after a restart: another incarnation's hold)."""

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
        await asyncio.to_thread(self._write_outcomes, self._take())

    async def insert(self, res: Reservation) -> None:
        row = BudgetReservationRow(
            id=res.id, tenant_id=res.tenant_id, key_id=res.key_id, request_id=res.request_id,
            counters=[c.key for c in res.counters], amount_nanos=res.amount_nanos, status="held",
            created_at=res.created_at, expires_at=res.expires_at)
        await asyncio.to_thread(self._insert, row)

    def _insert(self, row: BudgetReservationRow) -> None:
        with self._sf.begin() as session:
            session.add(row)

    def finish(self, reservation_id: str, status: str, settled_nanos: int | None) -> None:
        """Queue the outcome of a reservation (settled | released); never blocks."""
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
