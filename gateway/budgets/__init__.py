"""Budgets and rate limits: atomic holds per tenant/key, UTC periods, alerts.

Public API (import from here). Money is integer nano-USD (``gateway.money``). The request path
reserves a worst case with ``Budgets.reserve`` and gets a ``Hold`` (``settle(nanos)`` /
``release()``), checks rate limits with ``RateLimiter``; the lifespan uses
``build_budget_runtime``. Must not import routes, the app, the pipeline or providers.
"""

from gateway.budgets.alerts import AlertNotifier
from gateway.budgets.factory import BudgetRuntime, build_budget_runtime
from gateway.budgets.holds import (
    REMAINING_HEADER,
    UNLIMITED,
    BudgetStatus,
    CounterRef,
    Hold,
    remaining_headers,
)
from gateway.budgets.memory_backend import MemoryCounters
from gateway.budgets.periods import PERIOD_NAMES, PeriodWindow, window_for
from gateway.budgets.policies import BudgetPolicy, PolicyStore, get_policy_rows, put_policy, subject_of
from gateway.budgets.rate_limit import MemoryRateStore, RateLimiter, RedisRateStore
from gateway.budgets.redis_backend import RedisCounters
from gateway.budgets.reservations import ReservationStore
from gateway.budgets.service import Budgets
from gateway.budgets.spend import SpendSource, spend_summary

__all__ = [
    "PERIOD_NAMES", "REMAINING_HEADER", "UNLIMITED", "AlertNotifier", "BudgetPolicy", "BudgetRuntime",
    "BudgetStatus", "Budgets", "CounterRef", "Hold", "MemoryCounters", "MemoryRateStore", "PeriodWindow",
    "PolicyStore", "RateLimiter", "RedisCounters", "RedisRateStore", "ReservationStore", "SpendSource",
    "build_budget_runtime", "get_policy_rows", "put_policy", "remaining_headers", "spend_summary",
    "subject_of", "window_for",
]
