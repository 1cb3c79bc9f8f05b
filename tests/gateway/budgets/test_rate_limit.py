"""Rate limits (GCRA): requests/min and tokens/min per key and tenant, in-process with an
injected clock and shared through Redis by two independent limiters."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from gateway.budgets import MemoryRateStore, PolicyStore, RateLimiter, RedisRateStore
from gateway.budgets.policies import BudgetPolicy
from gateway.errors import RateLimited
from tests.gateway.budgets_support import Caller, small_settings


class Tick:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def policies(**tenant: int | None) -> PolicyStore:
    store = PolicyStore(None, small_settings().budgets)
    store.set_override(BudgetPolicy("tenant:t1", "tenant", "t1", None, **tenant))  # type: ignore[arg-type]
    return store


async def test_requests_per_minute_burst_then_steady_rate() -> None:
    clock = Tick()
    limiter = RateLimiter(policies(requests_per_min=6), MemoryRateStore(clock))
    for _ in range(6):
        await limiter.check(Caller("t1"), 0)
    with pytest.raises(RateLimited) as err:
        await limiter.check(Caller("t1"), 0)
    assert err.value.status == 429 and err.value.code == "rate_limit_exceeded"
    assert err.value.headers["retry-after"] == "10"  # one request every 10 s
    clock.t += 9.5
    with pytest.raises(RateLimited):
        await limiter.check(Caller("t1"), 0)
    clock.t += 0.5
    await limiter.check(Caller("t1"), 0)


async def test_tokens_per_minute_and_denials_consume_nothing() -> None:
    clock = Tick()
    limiter = RateLimiter(policies(tokens_per_min=1000, requests_per_min=100), MemoryRateStore(clock))
    await limiter.check(Caller("t1"), 700)
    with pytest.raises(RateLimited) as err:
        await limiter.check(Caller("t1"), 400)
    assert int(err.value.headers["retry-after"]) == 6  # 100 tokens over → 6 s at 1000/min
    await limiter.check(Caller("t1"), 300)  # the denied 400 did not count
    with pytest.raises(RateLimited):
        await limiter.check(Caller("t1"), 1)
    with pytest.raises(RateLimited, match="more than"):
        await limiter.check(Caller("t1"), 5000)  # can never fit


async def test_key_and_tenant_limits_both_apply() -> None:
    store = policies(requests_per_min=3)
    store.set_override(BudgetPolicy("key:k1", "key", "t1", "k1", requests_per_min=2))
    limiter = RateLimiter(store, MemoryRateStore(Tick()))
    await limiter.check(Caller("t1", "k1"), 0)
    await limiter.check(Caller("t1", "k1"), 0)
    with pytest.raises(RateLimited):
        await limiter.check(Caller("t1", "k1"), 0)  # the key's own limit
    await limiter.check(Caller("t1", "k2"), 0)  # tenant has one left
    with pytest.raises(RateLimited):
        await limiter.check(Caller("t1", "k3"), 0)  # the tenant's limit


@pytest.mark.redis
async def test_limit_is_shared_by_two_limiters_through_redis(redis_url: str, redis_prefix: str) -> None:
    clients = [Redis.from_url(redis_url) for _ in range(2)]
    try:
        store = policies(requests_per_min=10, tokens_per_min=600)
        limiters = [RateLimiter(store, RedisRateStore(c, prefix=redis_prefix)) for c in clients]
        allowed = 0
        retry_after = set()
        for i in range(30):
            try:
                await limiters[i % 2].check(Caller("t1"), 10)
                allowed += 1
            except RateLimited as exc:
                retry_after.add(int(exc.headers["retry-after"]))
        assert allowed == 10  # not 10 per replica
        assert retry_after and all(1 <= r <= 6 for r in retry_after)
    finally:
        async for key in clients[0].scan_iter(match=redis_prefix + "*"):
            await clients[0].delete(key)
        for c in clients:
            await c.aclose()
