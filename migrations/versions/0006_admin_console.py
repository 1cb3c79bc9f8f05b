"""The admin console: an audit log of admin actions (``admin_audit``) and acknowledged alerts
(``budget_alerts.acknowledged_at``), and indexes on ``requests(created_at)`` and ``daily_spend(day)`` for the
overview's window over every tenant (one range scan each).

Revision ID: 0006_admin_console
Revises: 0005_routing_outcomes
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_admin_console"
down_revision: str | Sequence[str] | None = "0005_routing_outcomes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=64)


def upgrade() -> None:
    op.create_table(
        "admin_audit",
        sa.Column("id", ID, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=120), nullable=False),
        sa.Column("client", sa.String(length=80), nullable=False),
        sa.Column("action", sa.String(length=40), nullable=False),
        sa.Column("target", sa.String(length=80), nullable=False),
        sa.Column("tenant_id", ID, nullable=True),
        sa.Column("before", sa.JSON(), nullable=True),
        sa.Column("after", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_admin_audit"),
    )
    op.create_index("ix_admin_audit_created", "admin_audit", ["created_at"])
    op.create_index("ix_admin_audit_tenant_created", "admin_audit", ["tenant_id", "created_at"])
    with op.batch_alter_table("budget_alerts") as t:
        t.add_column(sa.Column("acknowledged_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_requests_created", "requests", ["created_at"])
    op.create_index("ix_daily_spend_day", "daily_spend", ["day"])


def downgrade() -> None:
    op.drop_index("ix_daily_spend_day", table_name="daily_spend")
    op.drop_index("ix_requests_created", table_name="requests")
    with op.batch_alter_table("budget_alerts") as t:
        t.drop_column("acknowledged_at")
    op.drop_index("ix_admin_audit_tenant_created", table_name="admin_audit")
    op.drop_index("ix_admin_audit_created", table_name="admin_audit")
    op.drop_table("admin_audit")
