"""Multi-replica budget counters in Redis: atomic Lua scripts, DB as source of truth.

Per counter key K (subject|period) under a prefix: hash ``K`` {spent, held}; ``K:res``
(reservation id → amount) and ``K:lease`` (reservation id → lease expiry, ms of Redis
TIME) for holds; ``K:stl`` (reservation id → settle time) with ``K:stl_amt`` / ``K:stl_req``
as a short settlement log. Reserve purges expired leases, checks every counter and holds
on all or none in one script, so replicas can never jointly overshoot.

``spent`` is (re)built from the database by ``rebuild``: spend in a consistent DB
snapshot + settlements of the last ``log_window_ms`` whose ledger rows are not in that
snapshot yet + settlements logged after it. A settlement older than the window whose
ledger row never arrived (its process died before the journal fsync) is dropped: the
ledger is the truth. If a ledger row is flushed before its settlement is logged (the
executor records, then settles), one rebuild may count it twice for a moment; the next
rebuild, which sees both, corrects it. The reconciler runs ``rebuild`` over active
counters periodically (one replica at a time, by a Redis lock) and expires stale leases.
Must not import routes, the app or the pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from redis.asyncio import Redis
from sqlalchemy.orm import Session, sessionmaker

from gateway.budgets.holds import CounterRef, CounterState, Hold, ReserveOutcome, SpentLoader
from gateway.budgets.periods import PeriodWindow, utc_now, window_from_key
from gateway.budgets.spend import ledger_nanos_by_request, spent_nanos
from gateway.log_safety import describe

log = logging.getLogger(__name__)

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function purge(k)
  local expired = redis.call('ZRANGEBYSCORE', k .. ':lease', '-inf', now)
  for _, rid in ipairs(expired) do
    local amt = redis.call('HGET', k .. ':res', rid)
    if amt then
      redis.call('HINCRBY', k, 'held', -tonumber(amt))
      redis.call('HDEL', k .. ':res', rid)
    end
    redis.call('ZREM', k .. ':lease', rid)
  end
  return #expired
end
local function touch(k, ttl)
  if ttl > 0 then
    for _, s in ipairs({'', ':res', ':lease', ':stl', ':stl_amt', ':stl_req'}) do
      redis.call('EXPIRE', k .. s, ttl)
    end
  end
end
local function state(k)
  local v = redis.call('HMGET', k, 'spent', 'held')
  return {tonumber(v[1] or '0'), tonumber(v[2] or '0')}
end
local function drop_hold(k, rid)
  local amt = redis.call('HGET', k .. ':res', rid)
  if amt then
    redis.call('HINCRBY', k, 'held', -tonumber(amt))
    redis.call('HDEL', k .. ':res', rid)
    redis.call('ZREM', k .. ':lease', rid)
  end
end
"""

# KEYS: counters. ARGV: res_id, amount, lease_ms, ttl_s, limit_1..limit_n
_RESERVE = _NOW + """
local amount = tonumber(ARGV[2])
for i = 1, #KEYS do
  if redis.call('HEXISTS', KEYS[i], 'spent') == 0 then return {-1, i} end
end
local out = {0, 0}
for i = 1, #KEYS do
  purge(KEYS[i])
  local s = state(KEYS[i])
  out[#out + 1] = s[1]; out[#out + 1] = s[2]
  if out[2] == 0 and s[1] + s[2] + amount > tonumber(ARGV[4 + i]) then out[2] = i end
end
if out[2] > 0 then return out end
out = {1, 0}
for i = 1, #KEYS do
  local k = KEYS[i]
  redis.call('HINCRBY', k, 'held', amount)
  redis.call('HSET', k .. ':res', ARGV[1], amount)
  redis.call('ZADD', k .. ':lease', now + tonumber(ARGV[3]), ARGV[1])
  touch(k, tonumber(ARGV[4]))
  local s = state(k)
  out[#out + 1] = s[1]; out[#out + 1] = s[2]
end
return out
"""

# KEYS: counters. ARGV: res_id, actual, request_id, ttl_s
_SETTLE = _NOW + """
local out = {}
for i = 1, #KEYS do
  local k = KEYS[i]
  drop_hold(k, ARGV[1])
  if redis.call('HEXISTS', k, 'spent') == 1 then redis.call('HINCRBY', k, 'spent', ARGV[2]) end
  redis.call('ZADD', k .. ':stl', now, ARGV[1])
  redis.call('HSET', k .. ':stl_amt', ARGV[1], ARGV[2])
  redis.call('HSET', k .. ':stl_req', ARGV[1], ARGV[3])
  touch(k, tonumber(ARGV[4]))
  local s = state(k)
  out[#out + 1] = s[1]; out[#out + 1] = s[2]
end
return out
"""

# KEYS: counters. ARGV: res_id
_RELEASE = _NOW + """
for i = 1, #KEYS do
  local k = KEYS[i]
  drop_hold(k, ARGV[1])
end
return 1
"""

# KEYS: counters. ARGV: none. Returns spent, held per counter (-1 spent when not loaded).
_SNAPSHOT = _NOW + """
local out = {}
for i = 1, #KEYS do
  purge(KEYS[i])
  local v = redis.call('HMGET', KEYS[i], 'spent', 'held')
  out[#out + 1] = tonumber(v[1] or '-1'); out[#out + 1] = tonumber(v[2] or '0')
end
return out
"""

# KEYS[1]: counter. ARGV: window_ms. Returns now, then (id, request id, amount) for each
# settlement of the last window_ms (older ones are flushed to the ledger, or were lost with it).
_LOG = _NOW + """
local k = KEYS[1]
local ids = redis.call('ZRANGEBYSCORE', k .. ':stl', '(' .. (now - tonumber(ARGV[1])), now)
local out = {now}
for _, rid in ipairs(ids) do
  out[#out + 1] = rid
  out[#out + 1] = redis.call('HGET', k .. ':stl_req', rid) or ''
  out[#out + 1] = redis.call('HGET', k .. ':stl_amt', rid) or '0'
end
return out
"""

# KEYS[1]: counter. ARGV: base, R1_ms, only_if_missing, ttl_s, trim_before_ms
_REBUILD = _NOW + """
local k = KEYS[1]
if ARGV[3] == '1' and redis.call('HEXISTS', k, 'spent') == 1 then
  return tonumber(redis.call('HGET', k, 'spent'))
end
local later = redis.call('ZRANGEBYSCORE', k .. ':stl', '(' .. ARGV[2], '+inf')
local total = tonumber(ARGV[1])
for _, rid in ipairs(later) do total = total + tonumber(redis.call('HGET', k .. ':stl_amt', rid) or '0') end
redis.call('HSET', k, 'spent', total)
if redis.call('HEXISTS', k, 'held') == 0 then redis.call('HSET', k, 'held', 0) end
local old = redis.call('ZRANGEBYSCORE', k .. ':stl', '-inf', ARGV[5])
for _, rid in ipairs(old) do
  redis.call('HDEL', k .. ':stl_amt', rid)
  redis.call('HDEL', k .. ':stl_req', rid)
end
redis.call('ZREMRANGEBYSCORE', k .. ':stl', '-inf', ARGV[5])
purge(k)
touch(k, tonumber(ARGV[4]))
return total
"""


def _pairs(values: Sequence[Any]) -> tuple[CounterState, ...]:
    return tuple(CounterState(int(values[i]), int(values[i + 1])) for i in range(0, len(values), 2))


def _ttl_s(window: PeriodWindow, now: datetime) -> int:
    left = window.seconds_left(now)
    return 0 if left is None else int(left) + 2 * 86400


def ref_from_key(counter_key: str, limit_nanos: int = 0) -> CounterRef:
    subject, _, period_key = counter_key.partition("|")
    scope, _, subject_id = subject.partition(":")
    return CounterRef(subject=subject, scope=scope, tenant_id=subject_id if scope == "tenant" else "",
                      key_id=subject_id if scope == "key" else None, window=window_from_key(period_key),
                      limit_nanos=limit_nanos)


class RedisCounters:
    def __init__(self, client: Redis, session_factory: sessionmaker[Session] | None, *,
                 prefix: str = "tiergate:", clock: Callable[[], datetime] = utc_now,
                 lease_ms: int = 300_000, log_window_ms: int = 60_000,
                 reconcile_interval_s: float = 30.0) -> None:
        self._r = client
        self._sf = session_factory
        self._prefix = prefix + "budget:"
        self._clock = clock
        self._lease_ms = lease_ms
        self._log_window_ms = log_window_ms
        self._interval = reconcile_interval_s
        self._reserve = client.register_script(_RESERVE)
        self._settle = client.register_script(_SETTLE)
        self._release = client.register_script(_RELEASE)
        self._snapshot = client.register_script(_SNAPSHOT)
        self._log = client.register_script(_LOG)
        self._rebuild = client.register_script(_REBUILD)
        self._task: asyncio.Task[None] | None = None
        self._loading: dict[str, asyncio.Future[int]] = {}

    def _k(self, ref: CounterRef | str) -> str:
        return self._prefix + (ref if isinstance(ref, str) else ref.key)

    async def start(self) -> None:
        if self._task is None and self._interval > 0:
            self._task = asyncio.create_task(self._reconcile_loop(), name="budget-reconciler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def reserve(self, res: Hold, load: SpentLoader) -> ReserveOutcome:
        keys = [self._k(r) for r in res.counters]
        ttl = max((_ttl_s(r.window, self._clock()) for r in res.counters), default=0)
        args: list[str | int] = [res.id, res.amount_nanos, self._lease_ms, ttl, *[r.limit_nanos for r in res.counters]]
        for _ in range(3):
            out = await self._reserve(keys=keys, args=args)
            if int(out[0]) != -1:
                break
            await self._load_once(res.counters[int(out[1]) - 1])
        else:
            raise RuntimeError("budget counter could not be loaded into Redis")
        denied = int(out[1])
        return ReserveOutcome(int(out[0]) == 1, _pairs(out[2:]), denied - 1 if denied else None)

    async def settle(self, res: Hold, actual_nanos: int) -> tuple[CounterState, ...]:
        if not res.counters:
            return ()
        ttl = max(_ttl_s(r.window, self._clock()) for r in res.counters)
        out = await self._settle(keys=[self._k(r) for r in res.counters],
                                 args=[res.id, actual_nanos, res.request_id or res.id, ttl])
        return _pairs(out)

    async def release(self, res: Hold) -> None:
        if res.counters:
            await self._release(keys=[self._k(r) for r in res.counters], args=[res.id])

    async def snapshot(self, refs: Sequence[CounterRef], load: SpentLoader) -> tuple[CounterState, ...]:
        if not refs:
            return ()
        states = _pairs(await self._snapshot(keys=[self._k(r) for r in refs], args=[]))
        if all(s.spent_nanos >= 0 for s in states):
            return states
        for ref, s in zip(refs, states, strict=True):
            if s.spent_nanos < 0:
                await self._load_once(ref)
        return _pairs(await self._snapshot(keys=[self._k(r) for r in refs], args=[]))

    async def _load_once(self, ref: CounterRef) -> int:
        """Cold-load a counter; concurrent requests for the same counter share one load."""
        task = self._loading.get(ref.key)
        if task is None:
            task = asyncio.ensure_future(self.rebuild(ref, only_if_missing=True))
            self._loading[ref.key] = task
            task.add_done_callback(lambda _t, k=ref.key: self._loading.pop(k, None))  # type: ignore[misc]
        return await asyncio.shield(task)

    async def rebuild(self, ref: CounterRef, *, only_if_missing: bool = False) -> int:
        """Set ``spent`` from the database truth (see module docstring); returns it."""
        key = self._k(ref)
        subject_id = ref.key_id if ref.scope == "key" else ref.tenant_id
        assert subject_id is not None
        base = 0
        r1 = 0
        if self._sf is None:
            r1 = int((await self._log(keys=[key], args=[self._log_window_ms]))[0])
        else:
            session = self._sf()
            try:
                await asyncio.to_thread(_begin_snapshot, session)
                db_spent = await asyncio.to_thread(spent_nanos, session, ref.scope, subject_id, ref.window)
                out = await self._log(keys=[key], args=[self._log_window_ms])
                r1 = int(out[0])
                logged: dict[str, int] = {}
                for i in range(1, len(out), 3):
                    req = out[i + 1].decode() if isinstance(out[i + 1], bytes) else str(out[i + 1])
                    logged[req] = logged.get(req, 0) + int(out[i + 2])
                in_db = await asyncio.to_thread(ledger_nanos_by_request, session, ref.scope, subject_id,
                                                ref.window, list(logged))
                base = db_spent + sum(max(amt - in_db.get(req, 0), 0) for req, amt in logged.items())
            finally:
                await asyncio.to_thread(session.close)
        ttl = _ttl_s(ref.window, self._clock())
        total = await self._rebuild(keys=[key], args=[base, r1, "1" if only_if_missing else "0", ttl,
                                                      r1 - self._log_window_ms])
        await self._r.sadd(self._prefix + "active", ref.key)
        return int(total)

    async def reconcile(self) -> int:
        """Rebuild every active counter from the database and expire stale leases."""
        n = 0
        for raw in await self._r.smembers(self._prefix + "active"):  # type: ignore[misc]
            key = raw.decode() if isinstance(raw, bytes) else str(raw)
            ref = ref_from_key(key)
            left = ref.window.seconds_left(self._clock())
            if left is not None and left <= 0 and not await self._r.exists(self._k(key)):
                await self._r.srem(self._prefix + "active", key)  # type: ignore[misc]
                continue
            await self.rebuild(ref)
            n += 1
        return n

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            lock = self._prefix + "reconciler-lock"
            try:
                if await self._r.set(lock, "1", nx=True, px=int(self._interval * 900)):
                    await self.reconcile()
            except Exception as err:
                log.error("budget reconcile failed; will retry next interval: %s", describe(err))


def _begin_snapshot(session: Session) -> None:
    """Start a transaction whose reads all see one snapshot (REPEATABLE READ on PostgreSQL)."""
    if session.get_bind().dialect.name == "postgresql":
        session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    else:
        # pysqlite opens no transaction for SELECTs, so each read would see a newer database: the
        # spend and the ledger-row check of one rebuild could then disagree (a row flushed between
        # them was counted in neither). An explicit BEGIN makes them one WAL snapshot.
        session.connection().exec_driver_sql("BEGIN")
