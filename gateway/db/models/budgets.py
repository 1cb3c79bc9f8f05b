"""Tables of the budgets: policies, persisted holds (``budget_reservations``), alert records.

Revision 0002_budgets creates them (and the ledger's ``(key_id, created_at)`` index, declared
with ``LedgerEntryRow`` in ``core``). Imports only SQLAlchemy and ``gateway.db.models.base``.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Index, Integer, Numeric, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import Base


class BudgetPolicyRow(Base):
    """A budget / rate-limit policy for one tenant (scope "tenant") or one API key (scope "key")."""

    __tablename__ = "budgets"

    id: Mapped[str] = mapped_column(String(80), primary_key=True)  # "tenant:<id>" | "key:<id>"
    scope: Mapped[str] = mapped_column(String(10))
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    key_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    period: Mapped[str] = mapped_column(String(10), default="month")
    limit_usd: Mapped[Decimal | None] = mapped_column(Numeric(18, 9), nullable=True)
    soft_limit_usd: Mapped[Decimal | None] = mapped_column(Numeric(18, 9), nullable=True)
    alert_thresholds: Mapped[list[float] | None] = mapped_column(JSON, nullable=True)
    requests_per_min: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_min: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class BudgetReservationRow(Base):
    """A budget hold (``gateway.budgets.Hold``) persisted while its upstream call runs (embedded mode).

    ``status``: held | settled | released | expired. A process that dies leaves rows
    ``held``; they count against the budget until ``expires_at`` (the lease) and are
    then marked ``expired``.
    """

    __tablename__ = "budget_reservations"
    __table_args__ = (Index("ix_budget_reservations_status_expires", "status", "expires_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    key_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    counters: Mapped[list[Any]] = mapped_column(JSON)
    amount_nanos: Mapped[int] = mapped_column(BigInteger)
    settled_nanos: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    status: Mapped[str] = mapped_column(String(10), default="held")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class BudgetAlertRow(Base):
    """One threshold crossed in one period for one subject: recorded once, then delivered."""

    __tablename__ = "budget_alerts"
    __table_args__ = (UniqueConstraint("subject", "period_key", "threshold_permille",
                                       name="uq_budget_alerts_once"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    subject: Mapped[str] = mapped_column(String(80))  # "tenant:<id>" | "key:<id>"
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    period_key: Mapped[str] = mapped_column(String(20))
    threshold_permille: Mapped[int] = mapped_column(Integer)
    spent_usd: Mapped[Decimal] = mapped_column(Numeric(18, 9))
    limit_usd: Mapped[Decimal] = mapped_column(Numeric(18, 9))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Set when an operator acknowledges the alert in the console (revision 0006_admin_console).
    acknowledged_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

