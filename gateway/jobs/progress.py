"""The operator's read-only views of batches (``tiergate batches``, worker progress logs): every
tenant's batches, one batch's lines by state, and an ETA at the rate lines have settled so far.
Plain functions on a Session; imports the jobs tables only."""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.db.models import Batch, BatchLine


def progress(session: Session, batch_id: str, now: datetime | None = None) -> dict[str, int]:
    """The batch's lines by state (pending, running, done, cancelled, expired); ``failed``: the
    done ones that did not answer 200; ``stalled`` (with ``now``): running lines whose lease ran
    out — their process stopped heartbeating (died) and they wait for a worker to claim them."""
    by_state = dict(session.execute(sa.select(BatchLine.state, sa.func.count()).where(
        BatchLine.batch_id == batch_id).group_by(BatchLine.state)).tuples().all())
    failed = session.scalar(sa.select(sa.func.count()).select_from(BatchLine).where(
        BatchLine.batch_id == batch_id, BatchLine.state == "done", BatchLine.status_code != 200)) or 0
    stalled = 0 if now is None else session.scalar(sa.select(sa.func.count()).select_from(BatchLine).where(
        BatchLine.batch_id == batch_id, BatchLine.state == "running", BatchLine.lease_until < now)) or 0
    states = ("pending", "running", "done", "cancelled", "expired")
    return {**{k: int(by_state.get(k, 0)) for k in states}, "failed": int(failed), "stalled": int(stalled)}


def all_batches(session: Session, *, tenant_id: str | None = None, status: str | None = None,
                limit: int = 50) -> list[Batch]:
    """Every tenant's batches (the operator's view), newest first."""
    q = sa.select(Batch)
    if tenant_id is not None:
        q = q.where(Batch.tenant_id == tenant_id)
    if status is not None:
        q = q.where(Batch.status == status)
    return list(session.scalars(q.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)))


def eta_seconds(p: dict[str, int], started: datetime | None, now: datetime) -> float | None:
    """Seconds until the lines left (pending and running) are done, at the rate lines have
    settled since the batch started (``progress``'s counts); None before any line settled."""
    settled = p["done"] + p["cancelled"] + p["expired"]
    left = p["pending"] + p["running"]
    if started is None or settled == 0:
        return None
    elapsed = (now - (started if started.tzinfo else started.replace(tzinfo=UTC))).total_seconds()
    return max(0.0, left * elapsed / settled) if elapsed > 0 else None
