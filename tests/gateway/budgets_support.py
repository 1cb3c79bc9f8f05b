"""Shared helpers for the budgets / rate-limit tests (not a test module)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from gateway.db.migrate import upgrade
from gateway.db.session import make_engine, make_session_factory
from gateway.settings import Settings, settings_from_dict

SMALL_CONFIG = {
    "models": {"m": {"provider": "local", "model": "x", "price": {"input": 1.0, "output": 2.0}}},
    "tiers": {t: {"model": "m", "max_output_tokens": 100} for t in
              ("none", "minimal", "low", "medium", "high", "xhigh")},
    "budgets": {"period": "month", "reservation_lease_s": 300},
}


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
