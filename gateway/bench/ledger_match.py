"""Ledger rows matched to the calls an upstream received, by id: every upstream call carries its
ledger row's id as ``X-Client-Request-Id`` (gateway.providers.base.CALL_ID_HEADER), so a bench's
mock upstream that records the ids it received can say, call by call, which call has no row,
which it received twice, and which rows have no call (requests cut after their intent was
journaled and before the upstream took them), with what those billed.

Bench-only (`tiergate bench soak`).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path


def ledger_rows(config: Path) -> list[tuple[str, str, Decimal]]:
    """Every ledger row's (id, status, cost)."""
    import sqlalchemy as sa

    from gateway.db.models import LedgerEntryRow
    from gateway.db.session import database_url, make_engine
    from gateway.settings import load_settings

    engine = make_engine(database_url(load_settings(config)))
    with engine.connect() as conn:
        rows = conn.execute(sa.select(LedgerEntryRow.id, LedgerEntryRow.status, LedgerEntryRow.cost_usd)).all()
    engine.dispose()
    return [(str(i), str(status), Decimal(cost)) for i, status, cost in rows]


@dataclass(frozen=True)
class Invariant:
    """Ledger rows matched to the upstream's calls by id (each call carries its row's id as
    ``X-Client-Request-Id``)."""

    calls: int  # calls the upstream received
    rows: int
    lost: int  # calls with no row
    repeated: int  # ids the upstream received more than once
    unsent: dict[str, tuple[int, Decimal]]  # rows whose call the upstream never received: status -> (n, cost)
    total: Decimal  # the ledger's sum

    @property
    def ok(self) -> bool:
        """Every call the upstream received has its one row. A row with no call is a request cut
        (client gone, or a kill -9 for ``interrupted``) after its intent was journaled and before the
        upstream took it: the gateway cannot tell that from a call the upstream had started, so it
        bills it as one (a stream cut before its first chunk: its prompt) — printed, not an error."""
        return self.lost == 0 and self.repeated == 0
    def line(self) -> str:
        unsent = ", ".join(f"{n} {status} (${cost})" for status, (n, cost) in sorted(self.unsent.items())) or "none"
        return (f"upstream calls {self.calls}, ledger rows {self.rows}: {self.calls - self.lost} calls matched to "
                f"their row by id, {self.lost} without a row, {self.repeated} ids seen twice; rows for requests cut "
                f"before the upstream took them (billed as if it had): {unsent}")


def match_rows(ids: dict[str | None, int], rows: list[tuple[str, str, Decimal]]) -> Invariant:
    row_ids = {i for i, _, _ in rows}
    unsent: dict[str, tuple[int, Decimal]] = {}
    for i, status, cost in rows:
        if i not in ids:
            n, c = unsent.get(status, (0, Decimal(0)))
            unsent[status] = (n + 1, c + cost)
    calls = sum(ids.values())
    lost = sum(n for i, n in ids.items() if i is None or i not in row_ids)
    return Invariant(calls, len(rows), lost, sum(1 for n in ids.values() if n > 1), unsent,
                     sum((c for _, _, c in rows), Decimal(0)))
