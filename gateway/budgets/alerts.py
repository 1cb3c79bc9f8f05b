"""Budget alerts: threshold crossings recorded once per period and delivered to a webhook.

``observe`` is called after each settlement and never blocks: crossings go onto a queue
that a background task drains. Each (subject, period, threshold) is inserted into
``budget_alerts`` under a unique constraint, so across replicas it is recorded exactly
once; only the replica whose insert succeeded delivers it (POST JSON to the URL in the
environment variable named by ``budgets.alert_webhook_env``), retrying with backoff and
recording attempts, delivery time and the last error on the row. Must not import routes,
the app or the pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

import httpx
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from gateway.budgets.periods import utc_now
from gateway.budgets.policies import BudgetPolicy
from gateway.db.models import BudgetAlertRow
from gateway.ids import fast_id
from gateway.log_safety import describe
from gateway.money import nanos_to_decimal, usd_number

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alert:
    id: str
    subject: str
    tenant_id: str
    period_key: str
    threshold: float
    spent_nanos: int
    limit_nanos: int
    created_at: datetime

    def payload(self) -> dict[str, Any]:
        return {"type": "budget.threshold_crossed", "id": self.id, "subject": self.subject,
                "tenant_id": self.tenant_id, "period": self.period_key, "threshold": self.threshold,
                "spent_usd": usd_number(self.spent_nanos), "limit_usd": usd_number(self.limit_nanos),
                "created_at": self.created_at.isoformat()}


class AlertNotifier:
    def __init__(self, session_factory: sessionmaker[Session] | None, *, webhook_url: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, max_attempts: int = 5,
                 backoff_s: float = 0.5, clock: Callable[[], datetime] = utc_now) -> None:
        self._sf = session_factory
        self._url = webhook_url
        self._transport = transport
        self._max_attempts = max_attempts
        self._backoff = backoff_s
        self._clock = clock
        self._seen: set[tuple[str, str, int]] = set()
        self._queue: asyncio.Queue[Alert] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        if self._task is None:
            self._client = httpx.AsyncClient(transport=self._transport, timeout=10.0)
            self._task = asyncio.create_task(self._run(), name="budget-alerts")

    async def stop(self) -> None:
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._queue.join(), timeout=5.0)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def observe(self, policy: BudgetPolicy, period_key: str, spent_nanos: int) -> None:
        """Queue an alert for each threshold ``spent_nanos`` has crossed, once per period. The
        thresholds are fractions of the hard limit, or of the soft limit when it is the only one."""
        base = policy.limit_nanos if policy.limit_nanos is not None else policy.soft_limit_nanos
        if base is None or base <= 0:
            return
        thresholds = set(policy.alert_thresholds)
        if policy.soft_limit_nanos is not None:  # crossing the soft limit always alerts
            thresholds.add(round(policy.soft_limit_nanos / base, 3))
        for t in sorted(thresholds):
            permille = round(t * 1000)
            mark = (policy.subject, period_key, permille)
            if t <= 0 or mark in self._seen or spent_nanos < base * Decimal(repr(t)):  # exact
                continue
            self._seen.add(mark)
            self._queue.put_nowait(Alert(fast_id(), policy.subject, policy.tenant_id, period_key, t,
                                         spent_nanos, base, self._clock()))

    async def drain(self) -> None:
        """Wait until every queued alert has been recorded and delivered (or given up)."""
        await self._queue.join()

    async def _run(self) -> None:
        while True:
            alert = await self._queue.get()
            try:
                if await asyncio.to_thread(self._record, alert):
                    await self._deliver(alert)
            except Exception as err:
                log.error("recording budget alert %s failed: %s", alert.id, describe(err))
                self._seen.discard((alert.subject, alert.period_key, round(alert.threshold * 1000)))
            finally:
                self._queue.task_done()

    def _record(self, alert: Alert) -> bool:
        """Insert once; False when another replica (or an earlier run) already recorded it."""
        if self._sf is None:
            return True
        try:
            with self._sf.begin() as session:
                session.add(BudgetAlertRow(
                    id=alert.id, subject=alert.subject, tenant_id=alert.tenant_id, period_key=alert.period_key,
                    threshold_permille=round(alert.threshold * 1000),
                    spent_usd=nanos_to_decimal(alert.spent_nanos),
                    limit_usd=nanos_to_decimal(alert.limit_nanos), created_at=alert.created_at,
                    attempts=0))
        except IntegrityError:
            return False
        return True

    async def _deliver(self, alert: Alert) -> None:
        if not self._url or self._client is None:
            return
        error: str | None = None
        for attempt in range(1, self._max_attempts + 1):
            try:
                resp = await self._client.post(self._url, json=alert.payload())
                error = None if resp.status_code < 300 else f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            await asyncio.to_thread(self._mark, alert.id, attempt, error)
            if error is None:
                return
            await asyncio.sleep(self._backoff * 2 ** (attempt - 1))
        log.error("budget alert %s not delivered after %d attempts: %s", alert.id, self._max_attempts, error)

    def _mark(self, alert_id: str, attempts: int, error: str | None) -> None:
        if self._sf is None:
            return
        values: dict[str, Any] = {"attempts": attempts, "last_error": error}
        if error is None:
            values["delivered_at"] = self._clock()
        with self._sf.begin() as session:
            session.execute(update(BudgetAlertRow).where(BudgetAlertRow.id == alert_id).values(**values))


def recent_alerts(session: Session, tenant_id: str, limit: int = 100) -> list[dict[str, Any]]:
    """A tenant's latest alerts (tenant- and key-level), newest first, for the admin views."""
    from sqlalchemy import select

    rows = session.scalars(select(BudgetAlertRow).where(BudgetAlertRow.tenant_id == tenant_id)
                           .order_by(BudgetAlertRow.created_at.desc()).limit(limit))
    return [{"id": r.id, "subject": r.subject, "period": r.period_key, "threshold": r.threshold_permille / 1000,
             "spent_usd": float(r.spent_usd), "limit_usd": float(r.limit_usd),
             "created_at": r.created_at.isoformat(), "delivered_at": r.delivered_at.isoformat() if r.delivered_at else None,
             "attempts": r.attempts, "last_error": r.last_error,
             "acknowledged_at": r.acknowledged_at.isoformat() if r.acknowledged_at else None} for r in rows]
