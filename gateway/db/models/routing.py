"""Routing tables: the classifier's logged decisions and the outcomes learned from.

``routing_decisions``: one row per request routed by the classifier (``model: "auto"``) — the arm
(tier) that ran, the greedy arm, the propensity of the one that ran (exploration makes it < 1),
the score, the classifier version and the prompt's hashed features (its text only when the tenant
allows prompt storage). ``routing_outcomes``: what came of an arm on a prompt — from client
feedback, pipeline reviews or imported evaluation files — with the propensity the learner weighs
it by. Imports only SQLAlchemy and ``gateway.db.models.base``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db.models.base import ID, Base, utcnow


class RoutingDecision(Base):
    __tablename__ = "routing_decisions"
    __table_args__ = (sa.Index("ix_routing_decisions_tenant_created", "tenant_id", "created_at"),)

    request_id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ID)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    arm: Mapped[str] = mapped_column(sa.String(16))
    greedy_arm: Mapped[str] = mapped_column(sa.String(16))
    propensity: Mapped[float] = mapped_column(sa.Float)
    explored: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    score: Mapped[float] = mapped_column(sa.Float)
    classifier_version: Mapped[str] = mapped_column(sa.String(64))
    features: Mapped[Any] = mapped_column(sa.JSON)
    prompt_text: Mapped[str | None] = mapped_column(sa.Text, nullable=True)


class RoutingOutcome(Base):
    __tablename__ = "routing_outcomes"

    # Arrival order, for the learner's checkpoint (clocks of replicas differ).
    seq: Mapped[int] = mapped_column(sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True,
                                     autoincrement=True)
    id: Mapped[str] = mapped_column(ID, unique=True)
    request_id: Mapped[str | None] = mapped_column(ID, nullable=True, index=True)
    tenant_id: Mapped[str | None] = mapped_column(ID, nullable=True)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=utcnow)
    source: Mapped[str] = mapped_column(sa.String(16))  # feedback | review | import
    arm: Mapped[str] = mapped_column(sa.String(16))
    outcome: Mapped[float] = mapped_column(sa.Float)
    propensity: Mapped[float] = mapped_column(sa.Float)
    cost_nanos: Mapped[int | None] = mapped_column(sa.BigInteger, nullable=True)
    classifier_version: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    features: Mapped[Any | None] = mapped_column(sa.JSON, nullable=True)
    prompt_text: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
