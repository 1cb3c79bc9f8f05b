"""The admin overview's effort mix of every tenant as an index-only scan: ``requests(created_at)``
(0006_admin_console) becomes ``requests(created_at, tenant_id, tier, pipeline, http_status)``,
every column the mix reads (gateway.db.admin_queries.tier_mix_by_tenant), so PostgreSQL answers
the window's range from the index alone where the visibility map allows (pages vacuumed since
their last write) instead of fetching each row's heap page. Its leading column is the old one,
so every range on ``created_at`` is served as before. Same on SQLite.

Revision ID: 0009_requests_mix_index
Revises: 0008_spend_rollups
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0009_requests_mix_index"
down_revision: str | Sequence[str] | None = "0008_spend_rollups"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MIX_COLUMNS = ["created_at", "tenant_id", "tier", "pipeline", "http_status"]


def upgrade() -> None:
    op.create_index("ix_requests_created_mix", "requests", MIX_COLUMNS)
    op.drop_index("ix_requests_created", table_name="requests")


def downgrade() -> None:
    op.create_index("ix_requests_created", "requests", ["created_at"])
    op.drop_index("ix_requests_created_mix", table_name="requests")
