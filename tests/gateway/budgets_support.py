"""Shared helpers for the budgets / rate-limit tests (not a test module)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from gateway.budgets import BudgetRuntime, BudgetStatus
from gateway.db.migrate import upgrade
from gateway.db.session import make_engine, make_session_factory
from gateway.money import nanos_to_decimal
from gateway.settings import Settings, settings_from_dict

SMALL_CONFIG = {
    "models": {"m": {"provider": "local", "model": "x", "price": {"input": 1.0, "output": 2.0}}},
    "tiers": {t: {"model": "m", "max_output_tokens": 100} for t in
              ("none", "minimal", "low", "medium", "high", "xhigh")},
    "budgets": {"period": "month", "reservation_lease_s": 300},
}


# The worst case of one call of the small config: 10 prompt tokens × $1/M + 100 output tokens
# (the tiers' max_output_tokens) × $2/M, in nano-USD.
W = 10 * 1_000 + 100 * 2_000


def usd(nanos: int) -> Decimal:
    """A nano-USD amount as the USD a budget policy is set in."""
    return nanos_to_decimal(nanos)


def small_settings(**budgets: object) -> Settings:
    cfg = {**SMALL_CONFIG, "budgets": {**SMALL_CONFIG["budgets"], **budgets}}  # type: ignore[dict-item]
    return settings_from_dict(cfg)


@dataclass(frozen=True)
class Caller:
    tenant_id: str
    key_id: str | None = None


class FakeClock:
    """An injectable UTC clock that only moves when told to."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime(2026, 11, 30, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **kw: float) -> None:
        self.now += timedelta(**kw)


def migrated_db(url: str) -> sessionmaker[Session]:
    """Run every Alembic revision against ``url`` and return a session factory for it."""
    upgrade(url)
    return make_session_factory(make_engine(url))


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tiergate.db'}"


ClockFn = Callable[[], datetime]


async def budgeted_call(rt: BudgetRuntime, caller: Caller, worst_nanos: int, cost_nanos: int, *,
                        tokens: int | None = None, pause_s: float = 0.0) -> BudgetStatus | None:
    """One upstream call on the live path, as ``BudgetedExecutor`` makes it: rate limits (when
    ``tokens`` is given), a ``Hold`` of the worst case, the "call" (``pause_s``), then the hold
    settled to what it cost — or released when the call fails or is cancelled."""
    if tokens is not None:
        await rt.rate_limiter.check(caller, tokens)
    hold = await rt.budgets.reserve(caller, worst_nanos)
    try:
        await asyncio.sleep(pause_s)
    except BaseException:
        await hold.release()
        raise
    return await hold.settle(cost_nanos)
