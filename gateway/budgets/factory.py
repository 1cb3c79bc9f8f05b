"""Builds the budgets runtime (Budgets, RateLimiter, alerts) from settings for the lifespan.

``settings.redis`` URL set → Redis counters and rate limits shared by all replicas;
unset → in-process counters with persisted reservations (one process). Redis counters run under
``budgets.redis_outage`` (gateway/budgets/outage.py). Must not import
routes, the app or the pipeline.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import httpx
from redis.asyncio import Redis
from sqlalchemy.orm import Session, sessionmaker

from gateway.budgets.alerts import AlertNotifier
from gateway.budgets.holds import CounterBackend
from gateway.budgets.memory_backend import MemoryCounters
from gateway.budgets.outage import GuardedCounters, GuardedRateStore, OutageGuard
from gateway.budgets.periods import utc_now
from gateway.budgets.policies import PolicyStore
from gateway.budgets.rate_limit import MemoryRateStore, RateLimiter, RateStore, RedisRateStore
from gateway.budgets.redis_backend import RedisCounters
from gateway.budgets.reservations import ReservationStore
from gateway.budgets.service import Budgets
from gateway.budgets.spend import SpendSource
from gateway.settings import Settings


@dataclass
class BudgetRuntime:
    budgets: Budgets
    rate_limiter: RateLimiter
    alerts: AlertNotifier
    redis: Redis | None = None
    owns_redis: bool = False

    async def start(self) -> None:
        await self.alerts.start()
        await self.budgets.start()

    async def stop(self) -> None:
        await self.budgets.stop()
        await self.alerts.stop()
        if self.redis is not None and self.owns_redis:
            await self.redis.aclose()


def build_budget_runtime(settings: Settings, session_factory: sessionmaker[Session] | None, *,
                         redis_client: Redis | None = None, redis_prefix: str | None = None,
                         clock: Callable[[], datetime] = utc_now,
                         webhook_transport: httpx.AsyncBaseTransport | None = None,
                         policy_ttl_s: float = 5.0, reconcile_interval_s: float = 30.0) -> BudgetRuntime:
    cfg = settings.budgets
    prefix = settings.redis.key_prefix if redis_prefix is None else redis_prefix
    owns = False
    if redis_client is None and settings.redis.resolved_url():
        redis_client = Redis.from_url(settings.redis.resolved_url() or "", socket_timeout=settings.redis.timeout_s,
                                      socket_connect_timeout=settings.redis.timeout_s)
        owns = True
    policies = PolicyStore(session_factory, cfg, ttl_s=policy_ttl_s)
    counters: CounterBackend
    store: RateStore
    if redis_client is not None:
        guard = OutageGuard(cfg.redis_outage)
        counters = GuardedCounters(RedisCounters(redis_client, session_factory, prefix=prefix, clock=clock,
                                                 lease_ms=int(cfg.reservation_lease_s * 1000),
                                                 reconcile_interval_s=reconcile_interval_s),
                                   cfg.redis_outage, local_share=cfg.redis_outage_local_share, guard=guard)
        store = GuardedRateStore(RedisRateStore(redis_client, prefix=prefix), guard)
    else:
        res_store = ReservationStore(session_factory) if session_factory is not None else None
        counters = MemoryCounters(res_store, clock=clock)
        store = MemoryRateStore()
    url = os.environ.get(cfg.alert_webhook_env) if cfg.alert_webhook_env else None
    alerts = AlertNotifier(session_factory, webhook_url=url, transport=webhook_transport, clock=clock)
    budgets = Budgets(policies, counters, SpendSource(session_factory), lease_s=cfg.reservation_lease_s,
                      clock=clock, alerts=alerts)
    return BudgetRuntime(budgets, RateLimiter(policies, store), alerts, redis_client, owns)
