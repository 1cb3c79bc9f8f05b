"""Spend rollups for the admin overview: ``tenant_spend_spans`` (per tenant, sums over aligned
spans of 1, 2, 4 … 256 days: any window is a few spans per tenant) and ``daily_tier_spend``
(every tenant's spend per day and tier), both maintained by the ledger applier in the
transaction that writes ``daily_spend`` (gateway.db.rollups). The upgrade backfills both from
``daily_spend`` (summed in Python as exact decimals, so they equal it to the nano-dollar).

Revision ID: 0007_spend_rollups
Revises: 0006_admin_console
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from gateway.db.rollups import rollup_rows

revision: str = "0007_spend_rollups"
down_revision: str | Sequence[str] | None = "0006_admin_console"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=64)
MONEY = sa.Numeric(18, 9)
CHUNK = 5000


def _sums() -> list[sa.Column[object]]:
    return [sa.Column("requests", sa.BigInteger(), nullable=False),
            sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
            sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
            sa.Column("cost_usd", MONEY, nullable=False),
            sa.Column("baseline_cost_usd", MONEY, nullable=False)]


def upgrade() -> None:
    spans = op.create_table(
        "tenant_spend_spans",
        sa.Column("span_days", sa.SmallInteger(), nullable=False),
        sa.Column("start_day", sa.Date(), nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        *_sums(),
        sa.PrimaryKeyConstraint("span_days", "start_day", "tenant_id", name="pk_tenant_spend_spans"),
    )
    tiers = op.create_table(
        "daily_tier_spend",
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        *_sums(),
        sa.PrimaryKeyConstraint("day", "tier", name="pk_daily_tier_spend"),
    )
    daily = sa.table("daily_spend", sa.column("tenant_id", ID), sa.column("day", sa.Date()),
                     sa.column("tier", sa.String(16)), sa.column("requests", sa.BigInteger()),
                     sa.column("prompt_tokens", sa.BigInteger()), sa.column("completion_tokens", sa.BigInteger()),
                     sa.column("cost_usd", MONEY), sa.column("baseline_cost_usd", MONEY))
    rows = [dict(r._mapping) for r in op.get_bind().execute(sa.select(daily))]
    span_rows, tier_rows = rollup_rows(rows)
    for table, out in ((spans, span_rows), (tiers, tier_rows)):
        for i in range(0, len(out), CHUNK):
            op.bulk_insert(table, out[i:i + CHUNK])


def downgrade() -> None:
    op.drop_table("daily_tier_spend")
    op.drop_table("tenant_spend_spans")
