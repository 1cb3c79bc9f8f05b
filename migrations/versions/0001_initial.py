"""Initial schema: tenants, api_keys, requests, ledger_entries, daily_spend, feedback.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_initial"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=64)
MONEY = sa.Numeric(precision=18, scale=9)
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", ID, nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("allow_prompt_storage", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("revoked_at", TS, nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])
    op.create_table(
        "requests",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("key_id", ID, nullable=True),
        sa.Column("requested_model", sa.String(length=255), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=True),
        sa.Column("effort_source", sa.String(length=16), nullable=True),
        sa.Column("classifier_score", sa.Float(), nullable=True),
        sa.Column("classifier_version", sa.String(length=64), nullable=True),
        sa.Column("pipeline", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_usd", MONEY, nullable=False),
        sa.Column("baseline_cost_usd", MONEY, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
    )
    op.create_index("ix_requests_tenant_created", "requests", ["tenant_id", "created_at"])
    op.create_table(
        "ledger_entries",
        sa.Column("id", ID, nullable=False),
        sa.Column("request_id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("key_id", ID, nullable=True),
        sa.Column("stage", sa.String(length=16), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("reasoning_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_usd", MONEY, nullable=False),
        sa.Column("baseline_cost_usd", MONEY, nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ledger_entries")),
    )
    op.create_index(op.f("ix_ledger_entries_request_id"), "ledger_entries", ["request_id"])
    op.create_index("ix_ledger_entries_tenant_created", "ledger_entries", ["tenant_id", "created_at"])
    op.create_table(
        "daily_spend",
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("reasoning_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_usd", MONEY, nullable=False),
        sa.Column("baseline_cost_usd", MONEY, nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "day", "model", "tier", name=op.f("pk_daily_spend")),
    )
    op.create_table(
        "feedback",
        sa.Column("id", ID, nullable=False),
        sa.Column("request_id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("label_tier", sa.String(length=16), nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("prompt_text", sa.Text(), nullable=True),
        sa.Column("features", sa.JSON(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_feedback")),
    )
    op.create_index(op.f("ix_feedback_request_id"), "feedback", ["request_id"])
    op.create_index(op.f("ix_feedback_tenant_id"), "feedback", ["tenant_id"])


def downgrade() -> None:
    op.drop_table("feedback")
    op.drop_table("daily_spend")
    op.drop_table("ledger_entries")
    op.drop_table("requests")
    op.drop_table("api_keys")
    op.drop_table("tenants")
