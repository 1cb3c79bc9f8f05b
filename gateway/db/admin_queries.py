"""Read-only queries behind the admin dashboard.

Spend, all-high baseline and savings come from the ``daily_spend`` aggregate only (never a
scan of the raw ledger); the overview's every-tenant reads come from its two rollups
(``tenant_spend_spans``, ``daily_tier_spend``: gateway.db.rollups), a few rows per tenant and
one per day and tier whatever the window. The effort-tier mix, pipeline share and the recent-requests table
read ``requests`` for one tenant over a bounded time window, so every query is a range scan
of the ``(tenant_id, created_at)`` index. Paging is keyset (``created_at``, ``id``), never
OFFSET. Every value goes through bound parameters. Callers own the session. Imports only
SQLAlchemy, gateway.db.models, gateway.db.rollups and ``SpendTotals`` from gateway.db.queries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.db.models import (
    ApiKey,
    BudgetAlertRow,
    BudgetPolicyRow,
    DailySpend,
    DailyTierSpend,
    LedgerEntryRow,
    Request,
    Tenant,
    TenantSpendSpan,
)
from gateway.db.queries import SpendTotals
from gateway.db.rollups import cover

MAX_PAGE = 200


@dataclass(frozen=True)
class TenantSpend:
    tenant_id: str
    name: str
    totals: SpendTotals


@dataclass(frozen=True)
class DaySpend:
    day: date
    totals: SpendTotals


@dataclass(frozen=True)
class TierMix:
    """Requests of one tenant since a point in time that ran (refused ones, HTTP 429 from a budget
    or rate limit, are only counted in ``refused``), by effort tier, and how many ran the pipeline."""

    total: int
    by_tier: dict[str, int]
    pipeline: int
    refused: int = 0

    @property
    def pipeline_share(self) -> float | None:
        return None if self.total == 0 else self.pipeline / self.total


@dataclass(frozen=True)
class RequestRow:
    id: str
    created_at: datetime
    key_id: str | None
    requested_model: str
    tier: str | None
    effort_source: str | None
    pipeline: bool
    status: str
    http_status: int | None
    latency_ms: float | None
    prompt_tokens: int
    completion_tokens: int
    cost_usd: Decimal
    baseline_cost_usd: Decimal


@dataclass(frozen=True)
class RequestPage:
    rows: list[RequestRow]
    next_cursor: tuple[datetime, str] | None  # pass back as ``before`` for the next (older) page


def _sums(table: Any = DailySpend) -> list[sa.ColumnElement[object]]:
    """The five summed columns of daily_spend or of one of its rollups (same column names)."""
    return [sa.func.coalesce(sa.func.sum(table.requests), 0),
            sa.func.coalesce(sa.func.sum(table.prompt_tokens), 0),
            sa.func.coalesce(sa.func.sum(table.completion_tokens), 0),
            sa.func.coalesce(sa.func.sum(table.cost_usd), 0),
            sa.func.coalesce(sa.func.sum(table.baseline_cost_usd), 0)]


def _totals(sums: Sequence[Any]) -> SpendTotals:
    """A SpendTotals from the five ``_sums()`` columns of one result row."""
    calls, prompt, completion, cost, baseline = sums
    return SpendTotals(int(calls or 0), int(prompt or 0), int(completion or 0),
                       Decimal(str(cost or 0)), Decimal(str(baseline or 0)))


def list_tenants(session: Session) -> list[tuple[str, str]]:
    """(id, name) of every tenant, by name."""
    return [(r[0], r[1]) for r in session.execute(sa.select(Tenant.id, Tenant.name).order_by(Tenant.name))]


def tenant_name(session: Session, tenant_id: str) -> str | None:
    return session.scalar(sa.select(Tenant.name).where(Tenant.id == tenant_id))


def overview_spend(session: Session, since: date, until: date) -> tuple[list[TenantSpend],
                                                                         dict[date, dict[str, SpendTotals]]]:
    """``spend_by_tenant`` and ``spend_by_day_tier`` over every tenant, both from the rollups: a
    few span rows per tenant and one row per day and tier, whatever the window."""
    return spend_by_tenant(session, since, until), spend_by_day_tier(session, since, until)


def spend_by_tenant(session: Session, since: date, until: date) -> list[TenantSpend]:
    """Every tenant with its spend in [since, until] (inclusive days); tenants that spent
    nothing appear with zeros, spend of deleted tenants appears under its id. Biggest first.
    Read from ``tenant_spend_spans``: the window's few covering spans (gateway.db.rollups.cover),
    each a primary-key range over the tenants, summed per tenant."""
    spans = cover(since, until)
    if not spans:
        return _with_names(session, {})
    t = TenantSpendSpan
    rows = session.execute(sa.select(t.tenant_id, *_sums(t))
                           .where(sa.or_(*(sa.and_(t.span_days == n, t.start_day == start) for n, start in spans)))
                           .group_by(t.tenant_id))
    return _with_names(session, {r[0]: _totals(r[1:]) for r in rows})


def _with_names(session: Session, spend: dict[str, SpendTotals]) -> list[TenantSpend]:
    names = dict((tid, name) for tid, name in list_tenants(session))
    zero = _totals((0, 0, 0, 0, 0))
    out = [TenantSpend(tid, names.get(tid, tid), spend.get(tid, zero)) for tid in set(names) | set(spend)]
    return sorted(out, key=lambda t: (-t.totals.cost_usd, t.name))


def spend_by_day(session: Session, since: date, until: date, tenant_id: str | None = None) -> list[DaySpend]:
    """Spend per day in [since, until] (days with no spend are left out), oldest first."""
    q = (sa.select(DailySpend.day, *_sums()).where(DailySpend.day >= since, DailySpend.day <= until)
         .group_by(DailySpend.day).order_by(DailySpend.day))
    if tenant_id is not None:
        q = q.where(DailySpend.tenant_id == tenant_id)
    return [DaySpend(r[0], _totals(r[1:])) for r in session.execute(q)]


def spend_total(session: Session, since: date, until: date, tenant_id: str | None = None) -> SpendTotals:
    q = sa.select(*_sums()).where(DailySpend.day >= since, DailySpend.day <= until)
    if tenant_id is not None:
        q = q.where(DailySpend.tenant_id == tenant_id)
    row = session.execute(q).one()
    return _totals(tuple(row))


def spend_by_tier(session: Session, since: date, until: date, tenant_id: str) -> dict[str, SpendTotals]:
    """One tenant's spend per tier in [since, until] (from daily_spend; all stages of a request)."""
    q = (sa.select(DailySpend.tier, *_sums()).where(DailySpend.tenant_id == tenant_id, DailySpend.day >= since,
                                                     DailySpend.day <= until).group_by(DailySpend.tier))
    return {r[0]: _totals(r[1:]) for r in session.execute(q)}


def tier_mix(session: Session, tenant_id: str, since: datetime) -> TierMix:
    """One tenant's requests created at or after ``since``: counts by tier (None → "unrouted")
    and how many ran the plan→execute→review pipeline."""
    refused_col = sa.case((Request.http_status == 429, 1), else_=0).label("refused")
    q = (sa.select(Request.tier, Request.pipeline, refused_col, sa.func.count())
         .where(Request.tenant_id == tenant_id, Request.created_at >= since)
         .group_by(Request.tier, Request.pipeline, refused_col))
    by_tier: dict[str, int] = {}
    total = pipeline = refused = 0
    for tier, ran_pipeline, was_refused, n in session.execute(q):
        if was_refused:
            refused += int(n)
            continue
        key = tier or "unrouted"
        by_tier[key] = by_tier.get(key, 0) + int(n)
        total += int(n)
        pipeline += int(n) if ran_pipeline else 0
    return TierMix(total, by_tier, pipeline, refused)


def tier_mix_by_tenant(session: Session, tenant_ids: Sequence[str], since: datetime) -> dict[str, TierMix]:
    """``tier_mix`` of every tenant in one grouped range scan of the ``(created_at, tenant_id, tier,
    pipeline, http_status)`` index, which holds every column read here (revision
    0009_requests_mix_index: index-only on PostgreSQL where the pages are vacuumed), never one query
    per tenant; tenants without requests get zeros."""
    refused = Request.http_status == 429
    q = (sa.select(Request.tenant_id, Request.tier,
                   sa.func.sum(sa.case((refused, 0), else_=1)),  # ran
                   sa.func.sum(sa.case((refused, 0), (Request.pipeline, 1), else_=0)),  # ran the pipeline
                   sa.func.sum(sa.case((refused, 1), else_=0)))  # refused (429)
         .where(Request.created_at >= since)
         .group_by(Request.tenant_id, Request.tier))  # summed in SQL: one row per tenant and tier
    acc: dict[str, tuple[dict[str, int], list[int]]] = {tid: ({}, [0, 0, 0]) for tid in tenant_ids}
    for tid, tier, ran, ran_pipeline, was_refused in session.execute(q):
        got = acc.get(tid)
        if got is None:
            continue
        by_tier, counts = got
        if ran:
            key = tier or "unrouted"
            by_tier[key] = by_tier.get(key, 0) + int(ran)
        counts[0] += int(ran)
        counts[1] += int(ran_pipeline)
        counts[2] += int(was_refused)
    return {tid: TierMix(c[0], by_tier, c[1], c[2]) for tid, (by_tier, c) in acc.items()}


def combine_mixes(mixes: Sequence[TierMix]) -> TierMix:
    by_tier: dict[str, int] = {}
    for m in mixes:
        for tier, n in m.by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    return TierMix(sum(m.total for m in mixes), by_tier, sum(m.pipeline for m in mixes),
                   sum(m.refused for m in mixes))


def recent_requests(session: Session, tenant_id: str, *, limit: int = 50,
                    before: tuple[datetime, str] | None = None) -> RequestPage:
    """One tenant's requests, newest first, ``limit`` (at most MAX_PAGE) per page; ``before``
    is the previous page's ``next_cursor``."""
    limit = max(1, min(limit, MAX_PAGE))
    q = sa.select(Request).where(Request.tenant_id == tenant_id)
    if before is not None:
        at, rid = before
        # created_at <= at is the index range; the OR breaks ties on equal timestamps by id.
        q = q.where(Request.created_at <= at, sa.or_(Request.created_at < at, Request.id < rid))
    q = q.order_by(Request.created_at.desc(), Request.id.desc()).limit(limit + 1)
    found = list(session.scalars(q))
    rows = [RequestRow(r.id, r.created_at, r.key_id, r.requested_model, r.tier, r.effort_source, r.pipeline, r.status,
                       r.http_status, r.latency_ms, r.prompt_tokens, r.completion_tokens,
                       Decimal(str(r.cost_usd)), Decimal(str(r.baseline_cost_usd))) for r in found[:limit]]
    nxt = (rows[-1].created_at, rows[-1].id) if len(found) > limit else None
    return RequestPage(rows, nxt)


@dataclass(frozen=True)
class KeyRow:
    """One API key of a tenant with its spend since a point in time and its own budget (if any)."""

    id: str
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    calls: int
    cost_usd: Decimal
    budget_period: str | None
    budget_limit_usd: Decimal | None
    budget_soft_limit_usd: Decimal | None
    requests_per_min: int | None
    tokens_per_min: int | None

    def to_json(self) -> dict[str, Any]:
        def num(v: Decimal | None) -> str | None:
            return None if v is None else format(Decimal(v).normalize(), "f")

        return {"id": self.id, "object": "api_key", "name": self.name, "prefix": self.prefix,
                "created_at": self.created_at.isoformat(),
                "revoked_at": None if self.revoked_at is None else self.revoked_at.isoformat(),
                "calls": self.calls, "cost_usd": str(self.cost_usd),
                "budget": None if self.budget_period is None else {
                    "period": self.budget_period, "limit_usd": num(self.budget_limit_usd),
                    "soft_limit_usd": num(self.budget_soft_limit_usd), "requests_per_min": self.requests_per_min,
                    "tokens_per_min": self.tokens_per_min}}


def keys_of_tenant(session: Session, tenant_id: str, since: datetime) -> list[KeyRow]:
    """A tenant's keys (newest first) with ledger spend since ``since`` (one grouped range scan of
    the ledger's (tenant_id, created_at) index) and key budgets (one indexed read)."""
    keys = list(session.scalars(sa.select(ApiKey).where(ApiKey.tenant_id == tenant_id)
                                .order_by(ApiKey.created_at.desc(), ApiKey.id)))
    spend = {r[0]: (int(r[1]), Decimal(str(r[2] or 0))) for r in session.execute(
        sa.select(LedgerEntryRow.key_id, sa.func.count(), sa.func.sum(LedgerEntryRow.cost_usd))
        .where(LedgerEntryRow.tenant_id == tenant_id, LedgerEntryRow.created_at >= since)
        .group_by(LedgerEntryRow.key_id))}
    budgets = {r.key_id: r for r in session.scalars(sa.select(BudgetPolicyRow).where(
        BudgetPolicyRow.tenant_id == tenant_id, BudgetPolicyRow.scope == "key"))}
    out = []
    for k in keys:
        calls, cost = spend.get(k.id, (0, Decimal(0)))
        b = budgets.get(k.id)
        out.append(KeyRow(k.id, k.name, k.prefix, k.created_at, k.revoked_at, calls, cost,
                          None if b is None else b.period, None if b is None else b.limit_usd,
                          None if b is None else b.soft_limit_usd, None if b is None else b.requests_per_min,
                          None if b is None else b.tokens_per_min))
    return out


def open_alerts_by_tenant(session: Session) -> dict[str, int]:
    """Unacknowledged alerts per tenant."""
    q = (sa.select(BudgetAlertRow.tenant_id, sa.func.count()).where(BudgetAlertRow.acknowledged_at.is_(None))
         .group_by(BudgetAlertRow.tenant_id))
    return {r[0]: int(r[1]) for r in session.execute(q)}


def add_totals(items: Sequence[SpendTotals]) -> SpendTotals:
    return SpendTotals(sum(t.calls for t in items), sum(t.prompt_tokens for t in items),
                       sum(t.completion_tokens for t in items), sum((t.cost_usd for t in items), Decimal(0)),
                       sum((t.baseline_cost_usd for t in items), Decimal(0)))


def days_and_total(day_tier: dict[date, dict[str, SpendTotals]]) -> tuple[list[DaySpend], SpendTotals]:
    """``spend_by_day`` and ``spend_total`` derived from ``spend_by_day_tier``'s rows (no second scan)."""
    per_day = [DaySpend(d, add_totals(list(tiers.values()))) for d, tiers in sorted(day_tier.items())]
    return per_day, add_totals([d.totals for d in per_day])


def spend_by_day_tier(session: Session, since: date, until: date,
                      tenant_id: str | None = None) -> dict[date, dict[str, SpendTotals]]:
    """Spend per day and tier in [since, until] (the stacked chart), oldest first: one tenant's
    from daily_spend, every tenant's from its ``daily_tier_spend`` rollup."""
    t: Any = DailySpend if tenant_id is not None else DailyTierSpend
    q = (sa.select(t.day, t.tier, *_sums(t)).where(t.day >= since, t.day <= until)
         .group_by(t.day, t.tier).order_by(t.day))
    if tenant_id is not None:
        q = q.where(DailySpend.tenant_id == tenant_id)
    out: dict[date, dict[str, SpendTotals]] = {}
    for r in session.execute(q):
        out.setdefault(r[0], {})[r[1]] = _totals(r[2:])
    return out


def latency_percentiles(session: Session, tenant_id: str, since: datetime,
                        points: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[str, dict[float, float]]:
    """Latency percentiles (ms) of one tenant's answered requests since ``since``, per tier
    (nearest rank; read from the (tenant_id, created_at) index range, latencies only)."""
    q = (sa.select(Request.tier, Request.latency_ms)
         .where(Request.tenant_id == tenant_id, Request.created_at >= since, Request.http_status == 200,
                Request.latency_ms.is_not(None)))
    by_tier: dict[str, list[float]] = {}
    for tier, ms in session.execute(q):
        if ms is not None:
            by_tier.setdefault(tier or "unrouted", []).append(float(ms))
    out: dict[str, dict[float, float]] = {}
    for tier, values in sorted(by_tier.items()):
        values.sort()
        out[tier] = {p: values[min(len(values) - 1, max(0, math.ceil(p * len(values)) - 1))] for p in points}
    return out


def spend_rows(session: Session, since: date, until: date) -> list[tuple[Any, ...]]:
    """(day, tenant_id, tenant name, tier, calls, prompt, completion, cost, baseline) per tenant, day
    and tier in [since, until], from daily_spend (a range scan of its day index), for CSV export."""
    q = (sa.select(DailySpend.day, DailySpend.tenant_id, sa.func.coalesce(Tenant.name, DailySpend.tenant_id),
                   DailySpend.tier, *_sums())
         .join(Tenant, Tenant.id == DailySpend.tenant_id, isouter=True)
         .where(DailySpend.day >= since, DailySpend.day <= until)
         .group_by(DailySpend.day, DailySpend.tenant_id, Tenant.name, DailySpend.tier)
         .order_by(DailySpend.day, DailySpend.tenant_id, DailySpend.tier))
    return [tuple(r) for r in session.execute(q)]


def key_spend_rows(session: Session, tenant_id: str, since: datetime) -> list[tuple[Any, ...]]:
    """(day, key_id, key name, tier, calls, cost, baseline) of one tenant's ledger rows since
    ``since`` (a range scan of the ledger's (tenant_id, created_at) index), for CSV export."""
    day = sa.func.date(LedgerEntryRow.created_at)
    q = (sa.select(day, LedgerEntryRow.key_id, sa.func.coalesce(ApiKey.name, ""), LedgerEntryRow.tier,
                   sa.func.count(), sa.func.coalesce(sa.func.sum(LedgerEntryRow.cost_usd), 0),
                   sa.func.coalesce(sa.func.sum(LedgerEntryRow.baseline_cost_usd), 0))
         .join(ApiKey, ApiKey.id == LedgerEntryRow.key_id, isouter=True)
         .where(LedgerEntryRow.tenant_id == tenant_id, LedgerEntryRow.created_at >= since)
         .group_by(day, LedgerEntryRow.key_id, ApiKey.name, LedgerEntryRow.tier)
         .order_by(day, LedgerEntryRow.key_id, LedgerEntryRow.tier))
    return [tuple(r) for r in session.execute(q)]
