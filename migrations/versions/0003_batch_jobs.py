"""Batch jobs: files, batches and their per-line state.

Revision ID: 0003_batch_jobs
Revises: 0002_budgets
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_batch_jobs"
down_revision: str | Sequence[str] | None = "0002_budgets"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(length=64)
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("key_id", ID, nullable=True),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("input_file_id", ID, nullable=False),
        sa.Column("completion_window", sa.String(length=8), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("output_file_id", ID, nullable=True),
        sa.Column("error_file_id", ID, nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        *(sa.Column(name, TS, nullable=True) for name in (
            "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
            "cancelling_at", "cancelled_at")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index("ix_batches_tenant_created", "batches", ["tenant_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", ID, nullable=False),
        sa.Column("custom_id", sa.String(length=256), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("request_id", ID, nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_until", TS, nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("response", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name=op.f("fk_batch_lines_batch_id_batches"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("batch_id", "custom_id", name=op.f("pk_batch_lines")),
        sa.UniqueConstraint("request_id", name=op.f("uq_batch_lines_request_id")),
    )
    op.create_index("ix_batch_lines_batch_state", "batch_lines", ["batch_id", "state"])


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("files")
