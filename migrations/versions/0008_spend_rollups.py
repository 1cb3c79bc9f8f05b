"""Spend rollups for the admin overview: ``tenant_spend_spans`` (per tenant, sums over aligned
spans of 1, 2, 4 … 256 days: any window is a few spans per tenant) and ``daily_tier_spend``
(every tenant's spend per day and tier), both maintained by the ledger applier in the
transaction that writes ``daily_spend`` (gateway.db.rollups). The upgrade backfills both from
``daily_spend``, streamed (summed in Python as exact decimals, so they equal it to the
nano-dollar; memory holds the rollups, not daily_spend).

Revision ID: 0008_spend_rollups
Revises: 0007_ledger_intents
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

from gateway.db.rollups import ROLLUP_SUMS, rollup_rows

revision: str = "0008_spend_rollups"
down_revision: str | Sequence[str] | None = "0007_ledger_intents"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=64)
MONEY = sa.Numeric(18, 9)
CHUNK = 5000  # rows per streamed read and per insert


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
    span_acc: dict[tuple[Any, ...], dict[str, Any]] = {}
    tier_acc: dict[tuple[Any, ...], dict[str, Any]] = {}
    result = op.get_bind().execute(sa.select(daily).execution_options(stream_results=True, yield_per=CHUNK))
    for part in result.mappings().partitions(CHUNK):  # streamed: memory is the rollups' size, not daily_spend's
        span_rows, tier_rows = rollup_rows([dict(r) for r in part])
        _merge(span_acc, span_rows, ("span_days", "start_day", "tenant_id"))
        _merge(tier_acc, tier_rows, ("day", "tier"))
    for table, acc in ((spans, span_acc), (tiers, tier_acc)):
        out = [acc[k] for k in sorted(acc)]
        for i in range(0, len(out), CHUNK):
            op.bulk_insert(table, out[i:i + CHUNK])


def _merge(acc: dict[tuple[Any, ...], dict[str, Any]], rows: list[dict[str, Any]], key: tuple[str, ...]) -> None:
    for row in rows:
        k = tuple(row[c] for c in key)
        cur = acc.get(k)
        if cur is None:
            acc[k] = row
        else:
            for c in ROLLUP_SUMS:
                cur[c] += row[c]


def downgrade() -> None:
    op.drop_table("daily_tier_spend")
    op.drop_table("tenant_spend_spans")
