"""Budgets: policies per tenant/key, persisted reservations, alert records; key-spend index.

Revision ID: 0002_budgets
Revises: 0001_initial
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_budgets"
down_revision: str | Sequence[str] | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=64)
MONEY = sa.Numeric(precision=18, scale=9)
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "budgets",
        sa.Column("id", sa.String(length=80), nullable=False),
        sa.Column("scope", sa.String(length=10), nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("key_id", ID, nullable=True),
        sa.Column("period", sa.String(length=10), nullable=False),
        sa.Column("limit_usd", MONEY, nullable=True),
        sa.Column("soft_limit_usd", MONEY, nullable=True),
        sa.Column("alert_thresholds", sa.JSON(), nullable=True),
        sa.Column("requests_per_min", sa.Integer(), nullable=True),
        sa.Column("tokens_per_min", sa.Integer(), nullable=True),
        sa.Column("updated_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budgets")),
    )
    op.create_index(op.f("ix_budgets_tenant_id"), "budgets", ["tenant_id"])
    op.create_table(
        "budget_reservations",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("key_id", ID, nullable=True),
        sa.Column("request_id", ID, nullable=True),
        sa.Column("counters", sa.JSON(), nullable=False),
        sa.Column("amount_nanos", sa.BigInteger(), nullable=False),
        sa.Column("settled_nanos", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.String(length=10), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budget_reservations")),
    )
    op.create_index("ix_budget_reservations_status_expires", "budget_reservations", ["status", "expires_at"])
    op.create_table(
        "budget_alerts",
        sa.Column("id", ID, nullable=False),
        sa.Column("subject", sa.String(length=80), nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("period_key", sa.String(length=20), nullable=False),
        sa.Column("threshold_permille", sa.Integer(), nullable=False),
        sa.Column("spent_usd", MONEY, nullable=False),
        sa.Column("limit_usd", MONEY, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("delivered_at", TS, nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budget_alerts")),
        sa.UniqueConstraint("subject", "period_key", "threshold_permille", name="uq_budget_alerts_once"),
    )
    op.create_index(op.f("ix_budget_alerts_tenant_id"), "budget_alerts", ["tenant_id"])
    op.create_index("ix_ledger_entries_key_created", "ledger_entries", ["key_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_ledger_entries_key_created", table_name="ledger_entries")
    op.drop_table("budget_alerts")
    op.drop_table("budget_reservations")
    op.drop_table("budgets")
