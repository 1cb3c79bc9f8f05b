"""Budgets and rate limits: atomic reservations per tenant/key, UTC periods, alerts.

Public API (import from here). Must not import routes, the app, the pipeline or
providers; the request path uses ``budget_guard`` and the lifespan uses
``build_budget_runtime``.
"""

from gateway.budgets.alerts import AlertNotifier
from gateway.budgets.factory import BudgetRuntime, build_budget_runtime
from gateway.budgets.guard import BudgetGuard, budget_guard
from gateway.budgets.memory_backend import MemoryCounters
from gateway.budgets.periods import PERIOD_NAMES, PeriodWindow, window_for
from gateway.budgets.policies import BudgetPolicy, PolicyStore, get_policy_rows, put_policy, subject_of
from gateway.budgets.rate_limit import MemoryRateStore, RateLimiter, RedisRateStore
from gateway.budgets.redis_backend import RedisCounters
from gateway.budgets.reservations import Reservation, ReservationStore, from_nanos, to_nanos, worst_case_cost
from gateway.budgets.service import REMAINING_HEADER, UNLIMITED, Budgets, BudgetStatus
from gateway.budgets.spend import SpendSource, spend_summary

__all__ = [
    "PERIOD_NAMES", "REMAINING_HEADER", "UNLIMITED", "AlertNotifier", "BudgetGuard", "BudgetPolicy",
    "BudgetRuntime", "BudgetStatus", "Budgets", "MemoryCounters", "MemoryRateStore", "PeriodWindow",
    "PolicyStore", "RateLimiter", "RedisCounters", "RedisRateStore", "Reservation", "ReservationStore",
    "SpendSource", "budget_guard", "build_budget_runtime", "from_nanos", "get_policy_rows", "put_policy",
    "spend_summary", "subject_of", "to_nanos", "window_for", "worst_case_cost",
]
