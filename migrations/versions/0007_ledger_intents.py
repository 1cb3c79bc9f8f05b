"""Ledger intents: one row per upstream call in flight (journaled before the call), deleted when
the call's ledger row lands; a dead process's intents are settled as ``interrupted`` rows.

Revision ID: 0007_ledger_intents
Revises: 0006_admin_console
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_ledger_intents"
down_revision: str | Sequence[str] | None = "0006_admin_console"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=64)
MONEY = sa.Numeric(18, 9)


def upgrade() -> None:
    op.create_table(
        "ledger_intents",
        sa.Column("id", ID, primary_key=True),
        sa.Column("owner", ID, nullable=False),
        sa.Column("request_id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("key_id", ID, nullable=True),
        sa.Column("stage", sa.String(length=16), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("max_output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("estimate_output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("price", sa.JSON(), nullable=False),
        sa.Column("estimate_cost_usd", MONEY, nullable=False),
        sa.Column("estimate_baseline_usd", MONEY, nullable=False),
        sa.Column("reserved_cost_usd", MONEY, nullable=False),
        sa.Column("reserved_baseline_usd", MONEY, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_ledger_intents_owner", "ledger_intents", ["owner"])


def downgrade() -> None:
    op.drop_index("ix_ledger_intents_owner", table_name="ledger_intents")
    op.drop_table("ledger_intents")
