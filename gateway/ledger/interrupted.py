"""Settling the intents of ledger processes that died mid-call (``ledger.interrupted_billing``).

For each dead owner (``owners.py``), every intent still in ``ledger_intents`` — a call that
started and whose own ledger row never arrived — becomes an ``interrupted`` ledger row with the
intent's id, billed at the cost the intent priced when the call started: ``estimate`` (prompt
tokens + ``ledger.interrupted_output_fraction`` of the output cap) or ``reserved`` (prompt + the
whole cap). The rows, their ``daily_spend`` increments and the removal of the intents commit in
one transaction through the applier (idempotent on the id: an intent whose call row is already
there is only removed). Run only after the journal replay is committed, so a finishing row that
sat in the journal is never mistaken for a missing one; a finishing row that still turns up
later supersedes the interrupted row (see ``applier._supersede_interrupted``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from gateway.db.models import LedgerIntentRow
from gateway.ledger.applier import write_records
from gateway.ledger.entries import CallIntent, LedgerEntry
from gateway.money import decimal_to_nanos

Policy = Literal["estimate", "reserved"]


def _intent(row: LedgerIntentRow) -> CallIntent:
    return CallIntent(id=row.id, request_id=row.request_id, tenant_id=row.tenant_id, key_id=row.key_id,
                      stage=row.stage, tier=row.tier, model=row.model, prompt_tokens=row.prompt_tokens,
                      max_output_tokens=row.max_output_tokens, estimate_output_tokens=row.estimate_output_tokens,
                      price=dict(row.price), estimate_cost_nanos=decimal_to_nanos(row.estimate_cost_usd),
                      estimate_baseline_nanos=decimal_to_nanos(row.estimate_baseline_usd),
                      reserved_cost_nanos=decimal_to_nanos(row.reserved_cost_usd),
                      reserved_baseline_nanos=decimal_to_nanos(row.reserved_baseline_usd), owner=row.owner,
                      created_at=row.created_at)


def settle_owners(session_factory: sessionmaker[Session], owners: Sequence[str], policy: Policy) -> int:
    """Settle every unfinished intent of ``owners`` in one transaction; returns how many
    ``interrupted`` rows were written (a row already present for an intent's id is left as it
    is). Raises on a database error (nothing is then written)."""
    if not owners:
        return 0
    with session_factory() as session, session.begin():
        rows = session.scalars(select(LedgerIntentRow).where(LedgerIntentRow.owner.in_(list(owners)))).all()
        entries: list[LedgerEntry] = [_intent(r).interrupted_entry(policy) for r in rows]
        inserted = write_records(session, entries).entries_inserted if entries else 0
        session.execute(delete(LedgerIntentRow).where(LedgerIntentRow.owner.in_(list(owners))))
    return inserted
