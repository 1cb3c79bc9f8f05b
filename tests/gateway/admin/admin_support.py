"""Shared helpers for the admin dashboard tests (not a test module): the admin key, seeding
requests through the real Ledger, and the database's own spend sums."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import sqlalchemy as sa

from gateway.db.models import DailySpend
from gateway.ledger.entries import LedgerEntry, RequestRecord, new_entry_id
from gateway.money import usd_to_nanos
from gateway.providers.base import Usage
from tests.gateway.gateway_harness import Gateway
from tests.gateway.scripted_upstream import ADMIN_KEY

ADMIN = ADMIN_KEY  # what conftest.admin_key puts in TIERGATE_ADMIN_KEY


def seed(gw: Gateway, tenant_id: str, n: int, *, start: datetime | None = None) -> list[RequestRecord]:
    """n requests through the real Ledger: even ones direct on "low", odd ones a plan (high) +
    execute (low) pipeline; one request per hour going back from ``start``."""
    start = start or datetime.now(UTC)
    recs = []
    for i in range(n):
        at = start - timedelta(hours=i)
        rid = f"chatcmpl-{tenant_id[-6:]}-{i:03d}"
        stages = [("plan", "high"), ("execute", "low")] if i % 2 else [("direct", "low")]
        cost = base = Decimal(0)
        for stage, tier in stages:
            c = Decimal(i + 1) / Decimal(10**4) if tier == "low" else Decimal(3 * (i + 1)) / Decimal(10**4)
            b = Decimal(3 * (i + 1)) / Decimal(10**4)
            gw.ledger.record(LedgerEntry(new_entry_id(), rid, tenant_id, None, stage, tier, f"m-{tier}",
                                         Usage(prompt_tokens=10 + i, completion_tokens=5), usd_to_nanos(c), usd_to_nanos(b),
                                         created_at=at))
            cost, base = cost + c, base + b
        rec = RequestRecord(rid, tenant_id, None, "auto", "ok", tier="high" if i % 2 else "low",
                            effort_source="classifier", pipeline=bool(i % 2), http_status=200, latency_ms=12.0,
                            prompt_tokens=10 + i, completion_tokens=5, cost_nanos=usd_to_nanos(cost),
                            baseline_cost_nanos=usd_to_nanos(base), created_at=at)
        gw.ledger.record_request(rec)
        recs.append(rec)
    assert gw.ledger.flush(10)
    return recs


def db_sums(gw: Gateway, tenant_id: str | None = None) -> tuple[Decimal, Decimal]:
    q = sa.select(sa.func.sum(DailySpend.cost_usd), sa.func.sum(DailySpend.baseline_cost_usd))
    if tenant_id:
        q = q.where(DailySpend.tenant_id == tenant_id)
    with gw.session_factory() as s:
        cost, base = s.execute(q).one()
    return Decimal(str(cost)), Decimal(str(base))
