"""Routing on outcomes: the classifier's logged decisions (arm, propensity, features) and the
outcomes it learns from; a tenant's own exploration share and threshold target.

Revision ID: 0005_routing_outcomes
Revises: 0004_batch_attempts
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_routing_outcomes"
down_revision: str | Sequence[str] | None = "0004_batch_attempts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=64)


def upgrade() -> None:
    op.create_table(
        "routing_decisions",
        sa.Column("request_id", ID, primary_key=True),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("arm", sa.String(length=16), nullable=False),
        sa.Column("greedy_arm", sa.String(length=16), nullable=False),
        sa.Column("propensity", sa.Float(), nullable=False),
        sa.Column("explored", sa.Boolean(), nullable=False),
        sa.Column("score", sa.Float(), nullable=False),
        sa.Column("classifier_version", sa.String(length=64), nullable=False),
        sa.Column("features", sa.JSON(), nullable=False),
        sa.Column("prompt_text", sa.Text(), nullable=True),
    )
    op.create_index("ix_routing_decisions_tenant_created", "routing_decisions", ["tenant_id", "created_at"])
    op.create_table(
        "routing_outcomes",
        sa.Column("seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("id", ID, nullable=False, unique=True),
        sa.Column("request_id", ID, nullable=True),
        sa.Column("tenant_id", ID, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("arm", sa.String(length=16), nullable=False),
        sa.Column("outcome", sa.Float(), nullable=False),
        sa.Column("propensity", sa.Float(), nullable=False),
        sa.Column("cost_nanos", sa.BigInteger(), nullable=True),
        sa.Column("classifier_version", sa.String(length=64), nullable=True),
        sa.Column("features", sa.JSON(), nullable=True),
        sa.Column("prompt_text", sa.Text(), nullable=True),
    )
    op.create_index("ix_routing_outcomes_request_id", "routing_outcomes", ["request_id"])
    with op.batch_alter_table("tenants") as t:
        t.add_column(sa.Column("routing_exploration", sa.Float(), nullable=True))
        t.add_column(sa.Column("routing_target_quality", sa.Float(), nullable=True))
        t.add_column(sa.Column("routing_target_cost", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as t:
        t.drop_column("routing_target_cost")
        t.drop_column("routing_target_quality")
        t.drop_column("routing_exploration")
    op.drop_index("ix_routing_outcomes_request_id", table_name="routing_outcomes")
    op.drop_table("routing_outcomes")
    op.drop_index("ix_routing_decisions_tenant_created", table_name="routing_decisions")
    op.drop_table("routing_decisions")
