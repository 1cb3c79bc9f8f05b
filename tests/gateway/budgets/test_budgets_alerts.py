"""Budget alerts: each threshold recorded once per period (also across two notifiers sharing
the database), delivered to the webhook with retries, never blocking settlement."""

from __future__ import annotations

from pathlib import Path

import httpx
from sqlalchemy import select

from gateway.budgets import AlertNotifier, BudgetPolicy
from gateway.db.models import BudgetAlertRow
from gateway.money import usd_to_nanos
from tests.gateway.budgets_support import FakeClock, migrated_db, sqlite_url

POLICY = BudgetPolicy("tenant:t1", "tenant", "t1", None, "month", limit_nanos=usd_to_nanos(10),
                      alert_thresholds=(0.5, 0.8, 1.0))


async def test_thresholds_recorded_once_and_delivered_with_retries(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))
    calls: list[dict] = []
    failures = {"left": 2}

    def handler(request: httpx.Request) -> httpx.Response:
        import json
        calls.append(json.loads(request.content))
        if failures["left"]:
            failures["left"] -= 1
            return httpx.Response(503)
        return httpx.Response(204)

    notifiers = [AlertNotifier(sf, webhook_url="http://hook.test/alerts", transport=httpx.MockTransport(handler),
                               backoff_s=0.01, clock=FakeClock()) for _ in range(2)]
    for n in notifiers:
        await n.start()
    notifiers[0].observe(POLICY, "month:2026-11", usd_to_nanos(4))  # below 50%: nothing
    notifiers[0].observe(POLICY, "month:2026-11", usd_to_nanos(6))  # crosses 50%
    notifiers[1].observe(POLICY, "month:2026-11", usd_to_nanos(8.5))  # other replica: 50% again + 80%
    notifiers[0].observe(POLICY, "month:2026-11", usd_to_nanos(9))  # 50%, 80% already seen here
    for n in notifiers:
        await n.drain()
    with sf() as s:
        rows = s.scalars(select(BudgetAlertRow).order_by(BudgetAlertRow.threshold_permille)).all()
    assert [r.threshold_permille for r in rows] == [500, 800]
    assert all(r.delivered_at is not None for r in rows)
    assert sum(r.attempts for r in rows) == 4 and {r.last_error for r in rows} == {None}
    delivered = [c["threshold"] for c in calls]
    assert sorted(set(delivered)) == [0.5, 0.8] and len(calls) == 4  # 2 failures retried
    notifiers[0].observe(POLICY, "month:2026-12", usd_to_nanos(5))  # a new period alerts again
    await notifiers[0].drain()
    for n in notifiers:
        await n.stop()
    with sf() as s:
        assert len(s.scalars(select(BudgetAlertRow)).all()) == 3


async def test_undeliverable_webhook_is_recorded_not_raised(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    n = AlertNotifier(sf, webhook_url="http://hook.test/", transport=httpx.MockTransport(down),
                      max_attempts=3, backoff_s=0.001)
    await n.start()
    n.observe(POLICY, "month:2026-11", usd_to_nanos(10))
    await n.drain()
    await n.stop()
    with sf() as s:
        rows = s.scalars(select(BudgetAlertRow)).all()
    assert len(rows) == 3 and all(r.attempts == 3 and r.delivered_at is None for r in rows)
    assert all("ConnectError" in (r.last_error or "") for r in rows)
