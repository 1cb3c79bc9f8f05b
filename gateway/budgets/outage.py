"""What budgets do while Redis is unreachable (``budgets.redis_outage``), never a 500:

* ``fail_closed`` (default): a request that needs the shared counters (a hold, a budget status,
  a rate-limit check) is refused with 503 ``service_unavailable`` and ``retry-after`` before
  any upstream work starts.
* ``fail_open_to_local``: each replica falls back to in-process counters and rate limits
  (``MemoryCounters`` / ``MemoryRateStore``), loaded from the database's settled spend (the
  ledger, the truth) and enforcing ``budgets.redis_outage_local_share`` of each limit (1.0: each
  replica may spend what the database says is left; 1/N with N replicas: together they cannot
  overshoot). Holds taken locally are settled locally.

A hold taken locally is also settled in Redis when Redis answers by then (logged there like any
settlement, so a rebuild counts it once). Holds taken in Redis whose settlement or release fails (Redis went away mid-request) are not
lost money: the call's ledger row is the truth, and their reservations expire with their lease.
When Redis answers again, every active counter is rebuilt from the database at once and again
``RECOVERY_REBUILD_AGAIN_S`` later (``RedisCounters.reconcile``; also after a Redis restart, which loses the counters: they are
cold-loaded from the database on first use). Must not import routes, the app, the pipeline,
providers or the ledger.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Literal

from redis.exceptions import RedisError
from sqlalchemy.exc import DBAPIError

from gateway.budgets.holds import CounterRef, CounterState, Hold, ReserveOutcome, SpentLoader
from gateway.budgets.memory_backend import MemoryCounters
from gateway.budgets.rate_limit import Limit, MemoryRateStore, RateStore
from gateway.budgets.redis_backend import RedisCounters
from gateway.errors import ServiceUnavailable
from gateway.log_safety import describe

log = logging.getLogger(__name__)

OutagePolicy = Literal["fail_closed", "fail_open_to_local"]
RETRY_AFTER_S = 2
RECOVERY_REBUILD_AGAIN_S = 1.0


class CountersUnavailable(ServiceUnavailable):
    """The shared budget counters cannot be reached and the policy is ``fail_closed``."""


def _refused() -> CountersUnavailable:
    return CountersUnavailable("Budget counters are unavailable (Redis cannot be reached); the request was not "
                               "started. Retry later.", retry_after_s=RETRY_AFTER_S)


def _db_refused() -> ServiceUnavailable:
    return ServiceUnavailable("Budgets cannot be read right now (the database is unreachable). Retry later.",
                              retry_after_s=5)


class OutageGuard:
    """Tracks whether Redis is failing; a recovery triggers one rebuild from the database."""

    def __init__(self, policy: OutagePolicy) -> None:
        self.policy = policy
        self.down = False
        self.failures = 0
        self.on_recovered: list[asyncio.Task[int]] = []

    def failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        if not self.down:
            log.error("Redis unreachable (%s: %s); budgets %s until it answers again", what, describe(exc),
                      "refuse requests (503)" if self.policy == "fail_closed" else "fall back to local counters")
        self.down = True

    def succeeded(self) -> bool:
        """True once, on the first success after a failure."""
        if self.down:
            self.down = False
            log.warning("Redis answers again; budget counters are rebuilt from the database")
            return True
        return False


class GuardedCounters:
    """A ``CounterBackend``: ``RedisCounters`` under an outage policy (see the module docstring)."""

    def __init__(self, redis: RedisCounters, policy: OutagePolicy, *, local_share: float = 1.0,
                 guard: OutageGuard | None = None) -> None:
        self.redis = redis
        self.guard = guard or OutageGuard(policy)
        self.local = MemoryCounters()
        self._share = local_share
        self._local_holds: set[str] = set()
        self._rebuild: asyncio.Task[int] | None = None

    async def start(self) -> None:
        await self.redis.start()

    async def stop(self) -> None:
        await self.redis.stop()
        if self._rebuild is not None:
            self._rebuild.cancel()

    def _ok(self) -> None:
        if self.guard.succeeded() and (self._rebuild is None or self._rebuild.done()):
            self._rebuild = asyncio.ensure_future(self._reconcile())

    async def _reconcile(self) -> int:
        """Rebuild every active counter from the database now, and once more a little later:
        the ledger rows of the last local settlements may still be on their way to the database."""
        n = 0
        for delay in (0.0, RECOVERY_REBUILD_AGAIN_S):
            await asyncio.sleep(delay)
            try:
                n = await self.redis.reconcile()
            except Exception as exc:  # the periodic reconciler retries; logged, not raised into a request
                log.error("rebuilding budget counters after the Redis outage failed: %s", describe(exc))
        return n

    def _scaled(self, hold: Hold) -> Hold:
        refs = tuple(dataclasses.replace(r, limit_nanos=int(r.limit_nanos * self._share)) for r in hold.counters)
        return dataclasses.replace(hold, counters=refs)

    async def reserve(self, hold: Hold, load: SpentLoader) -> ReserveOutcome:
        try:
            outcome = await self.redis.reserve(hold, load)
        except DBAPIError as exc:  # a counter to cold-load while the database is away: never guessed
            raise _db_refused() from exc
        except RedisError as exc:
            self.guard.failed("reserve", exc)
            if self.guard.policy == "fail_closed":
                raise _refused() from exc
            self._local_holds.add(hold.id)
            try:
                return await self.local.reserve(self._scaled(hold), load)
            except BaseException:
                self._local_holds.discard(hold.id)
                raise
        self._ok()
        return outcome

    async def settle(self, hold: Hold, actual_nanos: int) -> tuple[CounterState, ...]:
        if hold.id in self._local_holds:
            self._local_holds.discard(hold.id)
            states = await self.local.settle(hold, actual_nanos)
            try:  # Redis may be back: count it there too (and log it, so a rebuild counts it once)
                await self.redis.settle(hold, actual_nanos)
            except RedisError:
                pass  # still down: the ledger row carries it into the rebuild at recovery
            else:
                self._ok()
            return states
        try:
            states = await self.redis.settle(hold, actual_nanos)
        except RedisError as exc:
            # The call is done and its ledger row carries the spend; the Redis reservation expires
            # with its lease and the counter is rebuilt from the database when Redis is back.
            self.guard.failed("settle", exc)
            raise _refused() from exc
        self._ok()
        return states

    async def release(self, hold: Hold) -> None:
        if hold.id in self._local_holds:
            self._local_holds.discard(hold.id)
            await self.local.release(hold)
            return
        try:
            await self.redis.release(hold)
        except RedisError as exc:  # nothing was spent; the reservation expires with its lease
            self.guard.failed("release", exc)
            return
        self._ok()

    async def snapshot(self, refs: Sequence[CounterRef], load: SpentLoader) -> tuple[CounterState, ...]:
        try:
            states = await self.redis.snapshot(refs, load)
        except DBAPIError as exc:
            raise _db_refused() from exc
        except RedisError as exc:
            self.guard.failed("status", exc)
            if self.guard.policy == "fail_closed":
                raise _refused() from exc
            return await self.local.snapshot(refs, load)
        self._ok()
        return states


class GuardedRateStore:
    """A ``RateStore``: the Redis one under the same outage policy (local GCRA when failing open)."""

    def __init__(self, redis: RateStore, guard: OutageGuard) -> None:
        self.redis, self.guard = redis, guard
        self.local = MemoryRateStore()

    async def acquire(self, limits: Sequence[Limit]) -> float | None:
        try:
            return await self.redis.acquire(limits)
        except RedisError as exc:
            self.guard.failed("rate limit", exc)
            if self.guard.policy == "fail_closed":
                raise _refused() from exc
            return await self.local.acquire(limits)
