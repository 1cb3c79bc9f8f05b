"""Rate limits per API key and per tenant: requests/min and tokens/min, by GCRA.

GCRA (generic cell rate algorithm) keeps one "theoretical arrival time" per limit; a
request of cost c is allowed when ``tat + c·T - 60 s <= now`` (T = 60 s / limit), which
allows a full minute's worth in a burst and then a steady rate. All limits of one
request are checked together and committed only if every one passes, so a denied
request consumes nothing. ``MemoryRateStore`` serves one process; ``RedisRateStore``
does the same in one Lua script (Redis TIME as the clock) so replicas share limits.
Must not import routes, the app or the pipeline.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

from gateway.budgets.policies import PolicyStore, PrincipalLike
from gateway.errors import RateLimited

WINDOW_S = 60.0


@dataclass(frozen=True)
class Limit:
    key: str  # e.g. "key:abc:rpm"
    per_minute: int
    cost: int


class RateStore(Protocol):
    async def acquire(self, limits: Sequence[Limit]) -> float | None:
        """Commit all limits and return None, or commit nothing and return retry-after seconds."""
        ...


def _gcra(tat: float, now: float, limit: Limit) -> tuple[float, float]:
    """(new_tat, wait_s) for one limit; wait_s > 0 means denied."""
    interval = WINDOW_S / limit.per_minute
    new_tat = max(tat, now) + limit.cost * interval
    return new_tat, new_tat - WINDOW_S - now


class MemoryRateStore:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._clock = monotonic
        self._tat: dict[str, float] = {}
        self._lock = asyncio.Lock()

    async def acquire(self, limits: Sequence[Limit]) -> float | None:
        async with self._lock:
            now = self._clock()
            updates = {}
            wait = 0.0
            for lim in limits:
                new_tat, w = _gcra(self._tat.get(lim.key, now), now, lim)
                updates[lim.key] = new_tat
                wait = max(wait, w)
            if wait > 0:
                return wait
            self._tat.update(updates)
            if len(self._tat) > 100_000:  # forget limits idle for over a window
                self._tat = {k: v for k, v in self._tat.items() if v > now}
            return None


_GCRA_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = tonumber(ARGV[1])
local wait = 0
local tats = {}
for i = 1, #KEYS do
  local per_min = tonumber(ARGV[2 * i])
  local cost = tonumber(ARGV[2 * i + 1])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tat < now then tat = now end
  local new_tat = tat + cost * window / per_min
  tats[i] = new_tat
  local w = new_tat - window - now
  if w > wait then wait = w end
end
if wait > 0 then return tostring(wait) end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], tostring(tats[i]), 'PX', math.ceil((tats[i] - now) * 1000) + 1000)
end
return '0'
"""


class RedisRateStore:
    def __init__(self, client: Redis, *, prefix: str = "tiergate:") -> None:
        self._prefix = prefix + "rl:"
        self._script = client.register_script(_GCRA_LUA)

    async def acquire(self, limits: Sequence[Limit]) -> float | None:
        if not limits:
            return None
        args: list[float | int] = [WINDOW_S]
        for lim in limits:
            args += [lim.per_minute, lim.cost]
        wait = float(await self._script(keys=[self._prefix + lim.key for lim in limits], args=args))
        return wait if wait > 0 else None


class RateLimiter:
    """Checks a caller's requests/min and tokens/min (key's and tenant's) in one step."""

    def __init__(self, policies: PolicyStore, store: RateStore) -> None:
        self._policies = policies
        self._store = store

    async def check(self, principal: PrincipalLike, tokens: int) -> None:
        """Count one request of ``tokens`` tokens, or raise ``RateLimited`` with retry-after."""
        limits: list[Limit] = []
        for p in await self._policies.for_principal(principal):
            if p.requests_per_min:
                limits.append(Limit(f"{p.subject}:rpm", p.requests_per_min, 1))
            if p.tokens_per_min and tokens > 0:
                if tokens > p.tokens_per_min:
                    raise RateLimited(
                        f"this request needs {tokens} tokens, more than the {p.scope}'s limit of "
                        f"{p.tokens_per_min} tokens per minute", headers={"retry-after": "60"})
                limits.append(Limit(f"{p.subject}:tpm", p.tokens_per_min, tokens))
        if not limits:
            return
        wait = await self._store.acquire(limits)
        if wait is not None:
            seconds = max(1, math.ceil(wait))
            raise RateLimited(f"rate limit reached; retry after {seconds} s",
                              headers={"retry-after": str(seconds)})
