"""The ledger's DB applier: idempotent database writes for one batch of records, in one
transaction (the syncer calls it for every batch it takes from the journal).

Ledger entries: ``INSERT ... ON CONFLICT (id) DO NOTHING RETURNING id`` (SQLite ≥ 3.35 and
PostgreSQL), and ``daily_spend`` is incremented only for the rows that statement actually
inserted — replaying a journal segment twice never double-counts; the overview's two rollups
of daily_spend (``tenant_spend_spans``, ``daily_tier_spend``: gateway.db.rollups) get the same
increments in the same statement batch, so they always equal daily_spend's sums. Requests: upsert by id,
where an ``in_progress`` record never overwrites a final one. Exceptions propagate (the
caller retries the batch durably); nothing here swallows an error. Money: the records' integer
nano-USD become ``Numeric(18, 9)`` decimals exactly (``nanos_to_decimal``); ``daily_spend``
increments are summed as integers first. Imports only gateway.db.models, gateway.db.rollups, gateway.money,
ledger.entries and ledger.applier_pg (PostgreSQL's bulk statements: one per table per batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date
from typing import Any

from sqlalchemy import delete, exists, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from gateway.db.models import (
    DailySpend,
    DailyTierSpend,
    LedgerEntryRow,
    LedgerIntentRow,
    Request,
    TenantSpendSpan,
)
from gateway.db.rollups import ROLLUP_SUMS, rollup_rows
from gateway.ledger import applier_pg
from gateway.ledger.entries import (
    IN_PROGRESS,
    INTERRUPTED,
    CallIntent,
    IntentVoid,
    LedgerEntry,
    Record,
    RequestRecord,
)
from gateway.money import decimal_to_nanos, nanos_to_decimal
from gateway.providers.base import Usage

_SUM_COLUMNS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens",
                "cost_usd", "baseline_cost_usd")


@dataclass(frozen=True)
class BatchResult:
    entries_inserted: int
    entries_duplicate: int
    requests_upserted: int


@dataclass(frozen=True)
class _Statements:
    """The applier's three statements for one dialect, built once: rebuilding them per batch
    (``excluded`` column collections, ``set_`` expressions) cost ~1 ms of GIL-holding Python per
    batch on the DB thread."""

    entries: Any
    daily: Any
    requests: Any
    intents: Any
    spans: Any
    tiers: Any


_STATEMENTS: dict[str, _Statements] = {}


def _build_statements(insert: Any) -> _Statements:
    table = LedgerEntryRow.__table__
    entries = insert(table).on_conflict_do_nothing(index_elements=["id"]).returning(table.c.id)
    ds = DailySpend.__table__
    up = insert(ds)
    up = up.on_conflict_do_update(
        index_elements=["tenant_id", "day", "model", "tier"],
        set_={c: ds.c[c] + up.excluded[c] for c in _SUM_COLUMNS})
    rt = Request.__table__
    rq = insert(rt)
    rq = rq.on_conflict_do_update(
        index_elements=["id"],
        set_={c.name: rq.excluded[c.name] for c in rt.columns if c.name not in ("id", "created_at")},
        where=(rt.c.status == IN_PROGRESS) | (rq.excluded.status != IN_PROGRESS))
    intents = insert(LedgerIntentRow.__table__).on_conflict_do_nothing(index_elements=["id"])
    return _Statements(entries, up, rq, intents,
                       _adding(insert, TenantSpendSpan.__table__, ["span_days", "start_day", "tenant_id"]),
                       _adding(insert, DailyTierSpend.__table__, ["day", "tier"]))


def _adding(insert: Any, table: Any, key: list[str]) -> Any:
    """An upsert that adds the row's ``ROLLUP_SUMS`` to the existing row's."""
    up = insert(table)
    return up.on_conflict_do_update(index_elements=key, set_={c: table.c[c] + up.excluded[c] for c in ROLLUP_SUMS})


def _statements_for(session: Session) -> _Statements:
    name = session.get_bind().dialect.name
    stmts = _STATEMENTS.get(name)
    if stmts is None:
        if name == "sqlite":
            stmts = _build_statements(sqlite.insert)
        elif name == "postgresql":
            stmts = _build_statements(postgresql.insert)
        else:
            raise RuntimeError(f"ledger writes support sqlite and postgresql, not {name}")
        _STATEMENTS[name] = stmts
    return stmts


def _entry_row(e: LedgerEntry) -> dict[str, Any]:
    u = e.usage
    return {"id": e.id, "request_id": e.request_id, "tenant_id": e.tenant_id, "key_id": e.key_id,
            "stage": e.stage, "tier": e.tier, "model": e.model, "prompt_tokens": u.prompt_tokens,
            "cached_tokens": u.cached_tokens, "completion_tokens": u.completion_tokens,
            "reasoning_tokens": u.reasoning_tokens, "cost_usd": nanos_to_decimal(e.cost_nanos),
            "baseline_cost_usd": nanos_to_decimal(e.baseline_cost_nanos), "status": e.status,
            "created_at": e.created_at}


def _request_row(r: RequestRecord) -> dict[str, Any]:
    row = r.to_json()
    for name in ("t", "cost_nanos", "baseline_cost_nanos"):
        del row[name]
    row["created_at"] = r.created_at
    row["cost_usd"] = nanos_to_decimal(r.cost_nanos)
    row["baseline_cost_usd"] = nanos_to_decimal(r.baseline_cost_nanos)
    return row


def _intent_row(i: CallIntent) -> dict[str, Any]:
    return {"id": i.id, "owner": i.owner, "request_id": i.request_id, "tenant_id": i.tenant_id,
            "key_id": i.key_id, "stage": i.stage, "tier": i.tier, "model": i.model,
            "prompt_tokens": i.prompt_tokens, "max_output_tokens": i.max_output_tokens,
            "estimate_output_tokens": i.estimate_output_tokens, "price": i.price,
            "estimate_cost_usd": nanos_to_decimal(i.estimate_cost_nanos),
            "estimate_baseline_usd": nanos_to_decimal(i.estimate_baseline_nanos),
            "reserved_cost_usd": nanos_to_decimal(i.reserved_cost_nanos),
            "reserved_baseline_usd": nanos_to_decimal(i.reserved_baseline_nanos), "created_at": i.created_at}


def _utc_day(e: LedgerEntry) -> date:
    dt = e.created_at
    return (dt.astimezone(UTC) if dt.tzinfo else dt).date()


def daily_rows(entries: Sequence[LedgerEntry], minus: Sequence[LedgerEntry] = ()) -> list[dict[str, Any]]:
    """Aggregate entries into one increment per (tenant, UTC day, model, tier); money is summed
    in integer nano-USD and converted to the column's decimal once. ``minus``: rows taken back
    (an ``interrupted`` row superseded by the call's own row), subtracted in the same increments."""
    agg: dict[tuple[str, date, str, str], dict[str, Any]] = {}
    signed = [(e, 1) for e in entries] + [(e, -1) for e in minus]
    for e, sign in signed:
        key = (e.tenant_id, _utc_day(e), e.model, e.tier)
        row = agg.get(key)
        if row is None:
            row = agg[key] = {"tenant_id": key[0], "day": key[1], "model": key[2], "tier": key[3],
                              "requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                              "reasoning_tokens": 0, "cost_usd": 0, "baseline_cost_usd": 0}
        row["requests"] += sign
        row["prompt_tokens"] += sign * e.usage.prompt_tokens
        row["cached_tokens"] += sign * e.usage.cached_tokens
        row["completion_tokens"] += sign * e.usage.completion_tokens
        row["reasoning_tokens"] += sign * e.usage.reasoning_tokens
        row["cost_usd"] += sign * e.cost_nanos
        row["baseline_cost_usd"] += sign * e.baseline_cost_nanos
    for row in agg.values():
        row["cost_usd"] = nanos_to_decimal(row["cost_usd"])
        row["baseline_cost_usd"] = nanos_to_decimal(row["baseline_cost_usd"])
    return [agg[k] for k in sorted(agg)]  # one lock order for every writer


def _fold_requests(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """Last record per id wins, except that in_progress never replaces a final status."""
    latest: dict[str, RequestRecord] = {}
    for r in records:
        prev = latest.get(r.id)
        if prev is None or r.status != IN_PROGRESS or prev.status == IN_PROGRESS:
            latest[r.id] = r
    return list(latest.values())


def write_batch(session_factory: sessionmaker[Session], records: Sequence[Record]) -> BatchResult:
    """Write one batch in one transaction; raises on any database error (nothing is half-written)."""
    with session_factory() as session, session.begin():
        return write_records(session, records)


def write_records(session: Session, records: Sequence[Record]) -> BatchResult:
    """``write_batch`` inside the caller's transaction (a batch line commits its ledger rows
    together with its result, so a line is billed exactly when it is done)."""
    entries: dict[str, LedgerEntry] = {}
    requests: list[RequestRecord] = []
    intents: dict[str, CallIntent] = {}
    voids: set[str] = set()
    for r in records:
        if isinstance(r, LedgerEntry):
            entries.setdefault(r.id, r)
        elif isinstance(r, CallIntent):
            intents.setdefault(r.id, r)
        elif isinstance(r, IntentVoid):
            voids.add(r.id)
        else:
            requests.append(r)
    stmts = _statements_for(session)
    conn = session.connection()
    rows = _rows_for(conn, stmts)
    # An intent whose call's row is in the same batch never needs to reach the database: the row
    # and the end of the intent commit together. (Its delete below stays: a replayed segment can
    # carry both after an earlier run committed the intent alone.)
    pending = [i for k, i in intents.items() if k not in entries]
    if pending:
        rows.insert_intents(conn, pending)
    inserted: set[str] = set()
    if entries:
        inserted = rows.insert_entries(conn, list(entries.values()))
        superseding = [e for i, e in entries.items() if i not in inserted and e.status != INTERRUPTED]
        taken_back = _supersede_interrupted(session, superseding) if superseding else []
        new_rows = daily_rows([e for i, e in entries.items() if i in inserted]
                              + [entries[old.id] for old in taken_back], minus=taken_back)
        if new_rows:
            conn.execute(stmts.daily, new_rows)
            spans, tiers = rollup_rows(new_rows)
            conn.execute(stmts.spans, spans)
            conn.execute(stmts.tiers, tiers)
    # An intent is done once its call has a ledger row: the row just written, or one written
    # before (a replayed segment re-inserts an intent whose row is already committed).
    done = list(entries.keys() | intents.keys())
    if done:
        rows.delete_done_intents(conn, done)
    if voids:
        conn.execute(delete(LedgerIntentRow).where(LedgerIntentRow.id.in_(list(voids))))
    folded = _fold_requests(requests)
    if folded:
        rows.upsert_requests(conn, folded)
    return BatchResult(len(inserted), len(entries) - len(inserted), len(folded))


class _GenericRows:
    """The row-level statements through SQLAlchemy's executemany (SQLite); PostgreSQL's bulk
    equivalents are applier_pg's functions of the same names."""

    def __init__(self, stmts: _Statements) -> None:
        self.stmts = stmts

    def insert_intents(self, conn: Any, intents: Sequence[CallIntent]) -> None:
        conn.execute(self.stmts.intents, [_intent_row(i) for i in intents])

    def insert_entries(self, conn: Any, entries: Sequence[LedgerEntry]) -> set[str]:
        return set(conn.execute(self.stmts.entries, [_entry_row(e) for e in entries]).scalars())

    def delete_done_intents(self, conn: Any, ids: Sequence[str]) -> None:
        for i in range(0, len(ids), 500):
            conn.execute(delete(LedgerIntentRow).where(LedgerIntentRow.id.in_(ids[i:i + 500]),
                                                       exists().where(LedgerEntryRow.id == LedgerIntentRow.id)))

    def upsert_requests(self, conn: Any, records: Sequence[RequestRecord]) -> None:
        conn.execute(self.stmts.requests, [_request_row(r) for r in records])


def _rows_for(conn: Any, stmts: _Statements) -> Any:
    """PostgreSQL: one statement per table per batch (applier_pg); otherwise one row at a time."""
    return applier_pg if conn.dialect.name == "postgresql" else _GenericRows(stmts)


def _row_entry(row: Any) -> LedgerEntry:
    return LedgerEntry(id=row.id, request_id=row.request_id, tenant_id=row.tenant_id, key_id=row.key_id,
                       stage=row.stage, tier=row.tier, model=row.model,
                       usage=Usage(prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens,
                                   cached_tokens=row.cached_tokens, reasoning_tokens=row.reasoning_tokens),
                       cost_nanos=decimal_to_nanos(row.cost_usd),
                       baseline_cost_nanos=decimal_to_nanos(row.baseline_cost_usd), status=row.status,
                       created_at=row.created_at)


def _supersede_interrupted(session: Session, finishing: Sequence[LedgerEntry]) -> list[LedgerEntry]:
    """A call's own row arriving after its intent was settled as ``interrupted`` (its process
    was taken for dead) replaces that row: the row is updated to the call's real usage and cost,
    and the old row is returned so ``daily_spend`` takes it back. Never billed twice."""
    t = LedgerEntryRow.__table__
    by_id = {e.id: e for e in finishing}
    old = [_row_entry(r) for r in session.execute(
        select(t).where(t.c.id.in_(list(by_id)), t.c.status == INTERRUPTED).with_for_update())]
    for prev in old:
        row = _entry_row(by_id[prev.id])
        del row["id"]
        session.connection().execute(update(LedgerEntryRow).where(LedgerEntryRow.id == prev.id,
                                                                  LedgerEntryRow.status == INTERRUPTED).values(**row))
    return old
