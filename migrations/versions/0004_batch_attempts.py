"""Batch jobs: which attempt's result a line kept, and why a batch failed.

``batch_lines.result_request_id`` names the attempt (its request id, as in the ledger) whose
result is in the output; other attempts of the line are billed as ``superseded`` requests.
``batches.errors`` holds the OpenAI ``errors`` list of a batch that failed before running
(its work could not be queued).

Revision ID: 0004_batch_attempts
Revises: 0003_batch_jobs
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_batch_attempts"
down_revision: str | Sequence[str] | None = "0003_batch_jobs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("batch_lines") as t:
        t.add_column(sa.Column("result_request_id", sa.String(length=64), nullable=True))
    with op.batch_alter_table("batches") as t:
        t.add_column(sa.Column("errors", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as t:
        t.drop_column("errors")
    with op.batch_alter_table("batch_lines") as t:
        t.drop_column("result_request_id")
