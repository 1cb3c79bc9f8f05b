"""Tables of the batch jobs: uploaded/produced files, batches, and one row per batch line.

A line's row is its durable state machine: ``pending`` → ``running`` (with ``lease_until`` and
an ``attempts`` fencing counter) → ``done`` (its HTTP status and response or error kept, and
``result_request_id``: the attempt they came from), or ``cancelled`` / ``expired`` when the
batch stopped before it ran. Imports only SQLAlchemy and ``gateway.db.models.base``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import ID, Base, utcnow

TS = sa.DateTime(timezone=True)
JSON = sa.JSON(none_as_null=True)  # Python None is SQL NULL, not the JSON text null


class FileObject(Base):
    """A file of one tenant (``purpose``: batch for inputs, batch_output for results)."""

    __tablename__ = "files"
    __table_args__ = (sa.Index("ix_files_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    purpose: Mapped[str] = mapped_column(sa.String(32))
    filename: Mapped[str] = mapped_column(sa.String(255))
    size: Mapped[int] = mapped_column("bytes", sa.BigInteger)
    content: Mapped[bytes] = mapped_column(sa.LargeBinary)
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (sa.Index("ix_batches_tenant_created", "tenant_id", "created_at"),
                      sa.Index("ix_batches_status", "status"))

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    key_id: Mapped[str | None] = mapped_column(ID, nullable=True)
    endpoint: Mapped[str] = mapped_column(sa.String(64))
    input_file_id: Mapped[str] = mapped_column(ID)
    completion_window: Mapped[str] = mapped_column(sa.String(8))
    status: Mapped[str] = mapped_column(sa.String(16))
    meta: Mapped[Any | None] = mapped_column("metadata", JSON, nullable=True)
    errors: Mapped[Any | None] = mapped_column(JSON, nullable=True)  # OpenAI's errors.data, when it failed
    output_file_id: Mapped[str | None] = mapped_column(ID, nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(ID, nullable=True)
    total: Mapped[int] = mapped_column(sa.Integer)
    created_at: Mapped[datetime] = mapped_column(TS, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(TS)
    in_progress_at: Mapped[datetime | None] = mapped_column(TS, nullable=True)
    finalizing_at: Mapped[datetime | None] = mapped_column(TS, nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(TS, nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(TS, nullable=True)
    expired_at: Mapped[datetime | None] = mapped_column(TS, nullable=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(TS, nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(TS, nullable=True)


class BatchLine(Base):
    """One request of a batch, keyed by (batch_id, custom_id): the unit that is run once."""

    __tablename__ = "batch_lines"
    __table_args__ = (sa.Index("ix_batch_lines_batch_state", "batch_id", "state"),)

    batch_id: Mapped[str] = mapped_column(ID, sa.ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    custom_id: Mapped[str] = mapped_column(sa.String(256), primary_key=True)
    line_no: Mapped[int] = mapped_column(sa.Integer)
    request_id: Mapped[str] = mapped_column(ID, unique=True)  # also the ledger rows' request_id
    body: Mapped[Any] = mapped_column(sa.JSON)
    state: Mapped[str] = mapped_column(sa.String(16))
    attempts: Mapped[int] = mapped_column(sa.Integer, default=0)
    lease_until: Mapped[datetime | None] = mapped_column(TS, nullable=True)
    status_code: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)
    response: Mapped[Any | None] = mapped_column(JSON, nullable=True)
    error: Mapped[Any | None] = mapped_column(JSON, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(TS, nullable=True)
    result_request_id: Mapped[str | None] = mapped_column(ID, nullable=True)  # the attempt whose result is kept
