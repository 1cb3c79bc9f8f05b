"""Embedded budget counters: in-process integers under one asyncio lock, plus the DB.

``spent`` is loaded from the database (daily_spend / indexed ledger) the first time a
counter is used in this process, so a restart continues from the truth; afterwards
settlements add to it in memory (the ledger records the same amounts durably).
Reservations are persisted (``ReservationStore``) before the upstream call; holds left
by a previous incarnation of the process count until their lease expires.
Single-process only: several replicas need the Redis backend. Must not import routes,
the app, the pipeline or Redis.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.exc import DBAPIError

from gateway.budgets.holds import CounterRef, CounterState, Hold, ReserveOutcome, SpentLoader
from gateway.budgets.periods import utc_now
from gateway.budgets.reservations import ReservationStore
from gateway.log_safety import describe

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """What one hold holds on which counters (by hold id)."""

    keys: tuple[str, ...]
    amount: int
    expires_at: datetime | None  # None: held by this live process (which ends it)


class MemoryCounters:
    def __init__(self, store: ReservationStore | None = None, *,
                 clock: Callable[[], datetime] = utc_now) -> None:
        self._store = store
        self._clock = clock
        self._lock = asyncio.Lock()
        self._spent: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._holds: dict[str, _Held] = {}
        self._loading: dict[str, asyncio.Future[int]] = {}

    async def start(self) -> None:
        if self._store is None:
            return
        await self._store.start()
        for row in await self._store.load_held(self._clock()):
            async with self._lock:
                self._add_hold(row.id, _Held(row.counter_keys, row.amount_nanos, row.expires_at))

    async def stop(self) -> None:
        if self._store is not None:
            await self._store.stop()

    def _add_hold(self, rid: str, hold: _Held) -> None:
        self._holds[rid] = hold
        for k in hold.keys:
            self._held[k] = self._held.get(k, 0) + hold.amount

    def _drop_hold(self, rid: str) -> _Held | None:
        hold = self._holds.pop(rid, None)
        if hold is not None:
            for k in hold.keys:
                self._held[k] -= hold.amount
        return hold

    def _expire_orphans(self, now: datetime) -> list[str]:
        expired = [rid for rid, h in self._holds.items() if h.expires_at is not None and h.expires_at <= now]
        for rid in expired:
            self._drop_hold(rid)
        return expired

    async def _ensure_loaded(self, refs: Sequence[CounterRef], load: SpentLoader) -> None:
        for ref in refs:
            if ref.key in self._spent:
                continue
            task = self._loading.get(ref.key)
            if task is None:  # concurrent first uses of one counter share a single DB read
                task = self._loading[ref.key] = asyncio.ensure_future(load(ref))
                task.add_done_callback(lambda _t, k=ref.key: self._loading.pop(k, None))  # type: ignore[misc]
            value = await asyncio.shield(task)
            async with self._lock:
                self._spent.setdefault(ref.key, value)

    def _state(self, key: str) -> CounterState:
        return CounterState(self._spent.get(key, 0), self._held.get(key, 0))

    async def reserve(self, res: Hold, load: SpentLoader) -> ReserveOutcome:
        await self._ensure_loaded(res.counters, load)
        async with self._lock:
            expired = self._expire_orphans(self._clock())
            for i, ref in enumerate(res.counters):
                if self._state(ref.key).remaining(ref.limit_nanos) < res.amount_nanos:
                    states = tuple(self._state(r.key) for r in res.counters)
                    outcome = ReserveOutcome(False, states, i)
                    break
            else:
                self._add_hold(res.id, _Held(tuple(r.key for r in res.counters), res.amount_nanos, None))
                outcome = ReserveOutcome(True, tuple(self._state(r.key) for r in res.counters))
        if self._store is not None:
            try:
                await self._store.expire(expired)
            except DBAPIError as exc:  # the database is away: the rows stay 'held' until their lease
                log.warning("budget holds: marking %d expired hold(s) failed (%s)", len(expired), describe(exc))
            if outcome.ok:
                try:
                    await self._store.insert(res)
                except DBAPIError as exc:
                    # The database is unreachable: the hold counts in this process only (a restart
                    # before the database is back forgets it; its calls' journaled intents still
                    # bill whatever they spent).
                    log.warning("budget hold %s kept in memory only (%s)", res.id, describe(exc))
                except BaseException:  # cancelled or failed: give the hold back, and mark its row
                    async with self._lock:  # released once the insert (maybe still running) lands
                        self._drop_hold(res.id)
                    self._store.finish(res.id, "released", None)
                    raise
        return outcome

    async def settle(self, res: Hold, actual_nanos: int) -> tuple[CounterState, ...]:
        async with self._lock:
            self._drop_hold(res.id)
            for ref in res.counters:
                if ref.key in self._spent:
                    self._spent[ref.key] += actual_nanos
            states = tuple(self._state(r.key) for r in res.counters)
        if self._store is not None:
            self._store.finish(res.id, "settled", actual_nanos)
        return states

    async def release(self, res: Hold) -> None:
        async with self._lock:
            self._drop_hold(res.id)
        if self._store is not None:
            self._store.finish(res.id, "released", None)

    async def snapshot(self, refs: Sequence[CounterRef], load: SpentLoader) -> tuple[CounterState, ...]:
        await self._ensure_loaded(refs, load)
        async with self._lock:
            self._expire_orphans(self._clock())
            return tuple(self._state(r.key) for r in refs)
