"""Reading settled spend from the database, the source of truth for budgets.

Tenant spend comes from ``daily_spend`` (maintained incrementally by the ledger
flusher in the same transaction as ledger rows), never from a raw-ledger scan. Key
spend comes from ``ledger_entries`` through the (key_id, created_at) index that
revision 0002_budgets adds; it is read only when a counter is first loaded or
reconciled, never per request. Must not import routes, the app or the pipeline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from gateway.budgets.periods import PeriodWindow
from gateway.db.models import Base
from gateway.errors import ServiceUnavailable
from gateway.money import decimal_to_nanos


def _table(name: str) -> Table:
    return Base.metadata.tables[name]


def spent_nanos(session: Session, scope: str, subject_id: str, window: PeriodWindow) -> int:
    """Settled spend of one subject in one window, in nano-dollars."""
    if scope == "tenant":
        t = _table("daily_spend")
        stmt = select(func.coalesce(func.sum(t.c.cost_usd), 0)).where(t.c.tenant_id == subject_id)
        if window.start is not None and window.end is not None:
            stmt = stmt.where(t.c.day >= window.first_day, t.c.day < window.end_day)
    else:
        t = _table("ledger_entries")
        stmt = select(func.coalesce(func.sum(t.c.cost_usd), 0)).where(t.c.key_id == subject_id)
        if window.start is not None and window.end is not None:
            stmt = stmt.where(t.c.created_at >= window.start, t.c.created_at < window.end)
    value = session.execute(stmt).scalar_one()
    return decimal_to_nanos(value)


def ledger_nanos_by_request(session: Session, scope: str, subject_id: str, window: PeriodWindow,
                            request_ids: Sequence[str]) -> dict[str, int]:
    """Ledger cost per request id (for the reconciler's not-yet-flushed settlements)."""
    if not request_ids:
        return {}
    t = _table("ledger_entries")
    column = t.c.tenant_id if scope == "tenant" else t.c.key_id
    stmt = (select(t.c.request_id, func.coalesce(func.sum(t.c.cost_usd), 0))
            .where(t.c.request_id.in_(list(request_ids)), column == subject_id)
            .group_by(t.c.request_id))
    if window.start is not None and window.end is not None:
        stmt = stmt.where(t.c.created_at >= window.start, t.c.created_at < window.end)
    return {rid: decimal_to_nanos(v) for rid, v in session.execute(stmt)}


def spend_summary(session: Session, tenant_id: str, since_day: Any, until_day: Any) -> list[dict[str, Any]]:
    """Per-day, per-model spend of a tenant from daily_spend (the dashboard/bench query)."""
    rows = session.execute(text(
        "SELECT day, model, tier, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens), "
        "SUM(cost_usd), SUM(baseline_cost_usd) FROM daily_spend "
        "WHERE tenant_id = :tenant AND day >= :since AND day < :until "
        "GROUP BY day, model, tier ORDER BY day, model, tier"),
        {"tenant": tenant_id, "since": since_day, "until": until_day})
    keys = ("day", "model", "tier", "requests", "prompt_tokens", "completion_tokens", "cost_usd",
            "baseline_cost_usd")
    return [dict(zip(keys, r, strict=True)) for r in rows]


class SpendSource:
    """Async facade over ``spent_nanos`` for the counters' cold loads."""

    def __init__(self, session_factory: sessionmaker[Session] | None) -> None:
        self._sf = session_factory

    async def spent(self, scope: str, subject_id: str, window: PeriodWindow) -> int:
        if self._sf is None:
            return 0
        try:
            return await asyncio.to_thread(self._spent, scope, subject_id, window)
        except DBAPIError as exc:  # a counter never loaded cannot be checked: refuse, never guess
            raise ServiceUnavailable("Budgets cannot be read right now (the database is unreachable). "
                                     "Retry later.", retry_after_s=5) from exc

    def _spent(self, scope: str, subject_id: str, window: PeriodWindow) -> int:
        assert self._sf is not None
        with self._sf() as session:
            return spent_nanos(session, scope, subject_id, window)

    @property
    def session_factory(self) -> sessionmaker[Session] | None:
        return self._sf


