"""Core tables: tenants, API keys, requests, the per-call ledger, daily spend aggregates (and
their two rollups for the admin overview) and feedback.

Money columns are ``Numeric(18, 9)`` (the ledger converts its integer nano-USD exactly at the
writer). The ledger tables carry no foreign keys on purpose: a ledger row must always be
writable (a deleted tenant must never make a journal batch un-insertable and stall the money
path). Imports only SQLAlchemy and ``gateway.db.models.base``.
"""

from __future__ import annotations

from datetime import date, datetime
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import ID, MONEY, Base, utcnow


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    allow_prompt_storage: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    # The share of this tenant's ``auto`` requests that explore a random tier (None: routing.exploration).
    routing_exploration: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    # The tenant's threshold target (None: routing.target_quality / routing.target_cost / the mix).
    routing_target_quality: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    routing_target_cost: Mapped[float | None] = mapped_column(sa.Float, nullable=True)


class ApiKey(Base):
    """An API key: only its SHA-256 hex digest and a short visible prefix are stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ID, sa.ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(sa.String(200), default="")
    prefix: Mapped[str] = mapped_column(sa.String(16))
    key_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True), nullable=True)


class Request(Base):
    """One client request (possibly several upstream calls, see ``LedgerEntryRow``)."""

    __tablename__ = "requests"
    # (created_at, ...): the admin overview's effort mix of every tenant in one range scan of an index
    # holding every column it reads, so PostgreSQL can answer it index-only (0009_requests_mix_index).
    __table_args__ = (sa.Index("ix_requests_tenant_created", "tenant_id", "created_at"),
                      sa.Index("ix_requests_created_mix", "created_at", "tenant_id", "tier", "pipeline", "http_status"))

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    key_id: Mapped[str | None] = mapped_column(ID, nullable=True)
    requested_model: Mapped[str] = mapped_column(sa.String(255))
    tier: Mapped[str | None] = mapped_column(sa.String(16), nullable=True)
    effort_source: Mapped[str | None] = mapped_column(sa.String(16), nullable=True)
    classifier_score: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    classifier_version: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    pipeline: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    status: Mapped[str] = mapped_column(sa.String(32))
    http_status: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    error_code: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    latency_ms: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    baseline_cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)


class LedgerEntryRow(Base):
    """One upstream call. ``id`` is a uuid chosen by the caller so journal replay is idempotent."""

    __tablename__ = "ledger_entries"
    # (key_id, created_at): key-level budget spend is read from the ledger (daily_spend has no key
    # column); this keeps that read a range scan over one key's rows in one period (0002_budgets).
    __table_args__ = (sa.Index("ix_ledger_entries_tenant_created", "tenant_id", "created_at"),
                      sa.Index("ix_ledger_entries_key_created", "key_id", "created_at"))

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    request_id: Mapped[str] = mapped_column(ID, index=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    key_id: Mapped[str | None] = mapped_column(ID, nullable=True)
    stage: Mapped[str] = mapped_column(sa.String(16))
    tier: Mapped[str] = mapped_column(sa.String(16))
    model: Mapped[str] = mapped_column(sa.String(255))
    prompt_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    baseline_cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    status: Mapped[str] = mapped_column(sa.String(16))
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)


class LedgerIntentRow(Base):
    """An upstream call that has started and whose ledger row has not arrived yet (journaled
    before the call, ``gateway.ledger.entries.CallIntent``). Deleted in the transaction that
    inserts the call's ledger row (same id); an intent whose ``owner`` (a ledger process) died is
    settled as an ``interrupted`` ledger row at its ``estimate_*`` or ``reserved_*`` cost."""

    __tablename__ = "ledger_intents"

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    owner: Mapped[str] = mapped_column(ID, index=True)
    request_id: Mapped[str] = mapped_column(ID)
    tenant_id: Mapped[str] = mapped_column(ID)
    key_id: Mapped[str | None] = mapped_column(ID, nullable=True)
    stage: Mapped[str] = mapped_column(sa.String(16))
    tier: Mapped[str] = mapped_column(sa.String(16))
    model: Mapped[str] = mapped_column(sa.String(255))
    prompt_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    max_output_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    estimate_output_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    price: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    estimate_cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    estimate_baseline_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    reserved_cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    reserved_baseline_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)


class DailySpend(Base):
    """Per tenant/day/model/tier sums of ledger rows, maintained incrementally by the ledger
    writer in the same transaction as the rows. ``requests`` counts upstream calls."""

    __tablename__ = "daily_spend"
    # (day): the admin overview's window over every tenant is a range scan (0006_admin_console).
    __table_args__ = (sa.Index("ix_daily_spend_day", "day"),)

    tenant_id: Mapped[str] = mapped_column(ID, primary_key=True)
    day: Mapped[date] = mapped_column(sa.Date, primary_key=True)
    model: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    tier: Mapped[str] = mapped_column(sa.String(16), primary_key=True)
    requests: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    baseline_cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))


class TenantSpendSpan(Base):
    """Per-tenant spend over aligned spans of days (gateway.db.rollups): for every span length in
    ``SPANS`` (1, 2, 4, … 256 days), the sums of the tenant's ``daily_spend`` rows in the span that
    starts on ``start_day`` (epoch days a multiple of the length). Any window of days is a few
    such spans (``rollups.cover``), so the admin overview's per-tenant totals read a few rows per
    tenant whatever the window, models and tiers. Maintained by the ledger applier in the
    transaction that writes daily_spend, from the same increments (0008_spend_rollups)."""

    __tablename__ = "tenant_spend_spans"

    span_days: Mapped[int] = mapped_column(sa.SmallInteger, primary_key=True)
    start_day: Mapped[date] = mapped_column(sa.Date, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ID, primary_key=True)
    requests: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    baseline_cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))


class DailyTierSpend(Base):
    """Every tenant's spend per UTC day and tier (the sums of daily_spend over tenants and
    models): the admin overview's per-day chart reads one row per day and tier. Maintained by
    the ledger applier with daily_spend (0008_spend_rollups)."""

    __tablename__ = "daily_tier_spend"

    day: Mapped[date] = mapped_column(sa.Date, primary_key=True)
    tier: Mapped[str] = mapped_column(sa.String(16), primary_key=True)
    requests: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))
    baseline_cost_usd: Mapped[Decimal] = mapped_column(MONEY, default=Decimal(0))


class Feedback(Base):
    """A label for the effort classifier: a review verdict or a user rating."""

    __tablename__ = "feedback"

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    request_id: Mapped[str] = mapped_column(ID, index=True)
    tenant_id: Mapped[str] = mapped_column(ID, index=True)
    source: Mapped[str] = mapped_column(sa.String(16))
    label_tier: Mapped[str] = mapped_column(sa.String(16))
    score: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    prompt_text: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    features: Mapped[Any | None] = mapped_column(sa.JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
