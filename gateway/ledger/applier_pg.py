"""The DB applier's bulk statements on PostgreSQL: each batch's ledger rows, intents, intent
deletions and request upserts as one statement apiece, the rows passed as one array per column
and expanded by ``unnest`` on the server.

Why: through SQLAlchemy's generic path a batch of ~500 records cost ~200 µs of GIL-holding
Python per request on the applier thread (psycopg parsing the multi-row ``INSERT ... VALUES
(...), (...) RETURNING`` text anew for every batch, ~7 ms each, and pipelined per-row
statements for the rest), which the event loop serving requests waited for. Here the SQL
text is fixed (parsed once, cached by psycopg), the Python work per row is building one tuple,
and PostgreSQL runs one statement per table instead of one per row.

Semantics are exactly ``applier``'s (the same statements, row for row): entries ``ON CONFLICT
(id) DO NOTHING RETURNING id``; intents ``ON CONFLICT DO NOTHING``; the intents of calls that
have a ledger row deleted; requests upserted where an ``in_progress`` record never overwrites a
final one. Every value is a bound parameter (arrays of plain data): nothing from a record is
ever part of the SQL text. Each statement needs unique ids per batch (the caller dedupes).
Imports only the ledger's records and gateway.money.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from gateway.ledger.entries import IN_PROGRESS, CallIntent, LedgerEntry, RequestRecord
from gateway.money import nanos_to_decimal

# (column, PostgreSQL array type of its parameter); a column's value is cast with ``cast`` when set.
_ENTRY_COLUMNS = (("id", "text"), ("request_id", "text"), ("tenant_id", "text"), ("key_id", "text"),
                  ("stage", "text"), ("tier", "text"), ("model", "text"), ("prompt_tokens", "bigint"),
                  ("cached_tokens", "bigint"), ("completion_tokens", "bigint"), ("reasoning_tokens", "bigint"),
                  ("cost_usd", "numeric"), ("baseline_cost_usd", "numeric"), ("status", "text"),
                  ("created_at", "timestamptz"))
_INTENT_COLUMNS = (("id", "text"), ("owner", "text"), ("request_id", "text"), ("tenant_id", "text"),
                   ("key_id", "text"), ("stage", "text"), ("tier", "text"), ("model", "text"),
                   ("prompt_tokens", "bigint"), ("max_output_tokens", "bigint"),
                   ("estimate_output_tokens", "bigint"), ("price", "text"), ("estimate_cost_usd", "numeric"),
                   ("estimate_baseline_usd", "numeric"), ("reserved_cost_usd", "numeric"),
                   ("reserved_baseline_usd", "numeric"), ("created_at", "timestamptz"))
_REQUEST_COLUMNS = (("id", "text"), ("tenant_id", "text"), ("key_id", "text"), ("requested_model", "text"),
                    ("tier", "text"), ("effort_source", "text"), ("classifier_score", "float8"),
                    ("classifier_version", "text"), ("pipeline", "boolean"), ("status", "text"),
                    ("http_status", "integer"), ("error_code", "text"), ("latency_ms", "float8"),
                    ("prompt_tokens", "bigint"), ("completion_tokens", "bigint"), ("cost_usd", "numeric"),
                    ("baseline_cost_usd", "numeric"), ("created_at", "timestamptz"))
_CASTS = {("ledger_intents", "price"): "json"}  # sent as JSON text (as sa.JSON writes it), stored as json


def _unnest_insert(table: str, columns: tuple[tuple[str, str], ...], tail: str) -> str:
    names = ", ".join(c for c, _ in columns)
    arrays = ", ".join(f"%b::{t}[]" for _, t in columns)  # %b: binary arrays (no per-element escaping)
    picked = ", ".join(f"u.{c}::{_CASTS[(table, c)]}" if (table, c) in _CASTS else f"u.{c}" for c, _ in columns)
    return f"INSERT INTO {table} ({names}) SELECT {picked} FROM unnest({arrays}) AS u({names}) {tail}"


_UPDATED = [c for c, _ in _REQUEST_COLUMNS if c not in ("id", "created_at")]
ENTRIES_SQL = _unnest_insert("ledger_entries", _ENTRY_COLUMNS, "ON CONFLICT (id) DO NOTHING RETURNING id")
INTENTS_SQL = _unnest_insert("ledger_intents", _INTENT_COLUMNS, "ON CONFLICT (id) DO NOTHING")
REQUESTS_SQL = _unnest_insert(
    "requests", _REQUEST_COLUMNS,
    "ON CONFLICT (id) DO UPDATE SET " + ", ".join(f"{c} = EXCLUDED.{c}" for c in _UPDATED)
    + " WHERE requests.status = %s OR EXCLUDED.status <> %s")
DELETE_DONE_SQL = ("DELETE FROM ledger_intents WHERE id = ANY(%b::text[]) AND EXISTS "
                   "(SELECT 1 FROM ledger_entries WHERE ledger_entries.id = ledger_intents.id)")


def _utc(dt: datetime) -> datetime:
    """A naive time is UTC (as ``applier.daily_rows`` reads it), so one array holds one kind."""
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=UTC)


def _columns(rows: list[tuple[Any, ...]], width: int) -> tuple[list[Any], ...]:
    """Rows → one list per column (the statement's array parameters)."""
    if not rows:
        return tuple([] for _ in range(width))
    return tuple(list(col) for col in zip(*rows, strict=True))


def insert_entries(conn: Any, entries: Sequence[LedgerEntry]) -> set[str]:
    """Insert ``entries`` (unique ids); the ids actually inserted (not already present)."""
    rows = [(e.id, e.request_id, e.tenant_id, e.key_id, e.stage, e.tier, e.model, e.usage.prompt_tokens,
             e.usage.cached_tokens, e.usage.completion_tokens, e.usage.reasoning_tokens,
             nanos_to_decimal(e.cost_nanos), nanos_to_decimal(e.baseline_cost_nanos), e.status, _utc(e.created_at))
            for e in entries]
    return set(conn.exec_driver_sql(ENTRIES_SQL, _columns(rows, len(_ENTRY_COLUMNS))).scalars())


def insert_intents(conn: Any, intents: Sequence[CallIntent]) -> None:
    rows = [(i.id, i.owner, i.request_id, i.tenant_id, i.key_id, i.stage, i.tier, i.model, i.prompt_tokens,
             i.max_output_tokens, i.estimate_output_tokens, json.dumps(i.price),
             nanos_to_decimal(i.estimate_cost_nanos), nanos_to_decimal(i.estimate_baseline_nanos),
             nanos_to_decimal(i.reserved_cost_nanos), nanos_to_decimal(i.reserved_baseline_nanos),
             _utc(i.created_at)) for i in intents]
    conn.exec_driver_sql(INTENTS_SQL, _columns(rows, len(_INTENT_COLUMNS)))


def delete_done_intents(conn: Any, ids: Sequence[str]) -> None:
    """Delete the intents among ``ids`` whose call has a ledger row."""
    conn.exec_driver_sql(DELETE_DONE_SQL, (list(ids),))


def upsert_requests(conn: Any, records: Sequence[RequestRecord]) -> None:
    """Upsert ``records`` (unique ids, folded by the caller)."""
    rows = [(r.id, r.tenant_id, r.key_id, r.requested_model, r.tier, r.effort_source, r.classifier_score,
             r.classifier_version, r.pipeline, r.status, r.http_status, r.error_code, r.latency_ms,
             r.prompt_tokens, r.completion_tokens, nanos_to_decimal(r.cost_nanos),
             nanos_to_decimal(r.baseline_cost_nanos), _utc(r.created_at)) for r in records]
    conn.exec_driver_sql(REQUESTS_SQL, (*_columns(rows, len(_REQUEST_COLUMNS)), IN_PROGRESS, IN_PROGRESS))
