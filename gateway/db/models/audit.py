"""The admin audit log: one row per state-changing admin action (console form, admin HTTP API):
who did it (the admin session or bearer and the client address), what (an action name and its
target), and the target's state before and after as JSON. Revision 0006_admin_console creates
it. Imports only SQLAlchemy and ``gateway.db.models.base``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import ID, Base, utcnow


class AdminAuditRow(Base):
    __tablename__ = "admin_audit"
    __table_args__ = (sa.Index("ix_admin_audit_created", "created_at"),
                      sa.Index("ix_admin_audit_tenant_created", "tenant_id", "created_at"))

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    actor: Mapped[str] = mapped_column(sa.String(120))  # "session:<id>" | "bearer"
    client: Mapped[str] = mapped_column(sa.String(80))  # the client address
    action: Mapped[str] = mapped_column(sa.String(40))  # e.g. "tenant.create", "key.revoke", "budget.set"
    target: Mapped[str] = mapped_column(sa.String(80))  # "tenant:<id>" | "key:<id>" | "alert:<id>"
    tenant_id: Mapped[str | None] = mapped_column(ID, nullable=True)
    before: Mapped[Any | None] = mapped_column(sa.JSON, nullable=True)
    after: Mapped[Any | None] = mapped_column(sa.JSON, nullable=True)
