"""Call intents in the ledger: journaled before a call, superseded by its row (same id), settled
as ``interrupted`` when their process is gone — and never billed twice, whichever way the rows
arrive (replays, a finishing row after the settlement, a voided call)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from gateway.db.models import DailySpend, LedgerEntryRow, LedgerIntentRow
from gateway.ledger import Ledger, LedgerEntry, new_entry_id
from gateway.ledger.applier import write_batch
from gateway.ledger.entries import CallIntent, IntentVoid
from gateway.ledger.interrupted import settle_owners
from gateway.ledger.journal import decode_line, encode_line
from gateway.providers.base import Usage


def _intent(call_id: str, owner: str = "o-dead") -> CallIntent:
    return CallIntent(id=call_id, request_id="req-1", tenant_id="t1", key_id="k1", stage="direct", tier="low",
                      model="m", prompt_tokens=10, max_output_tokens=100, estimate_output_tokens=50,
                      price={"input": 1.0, "cached_input": None, "output": 2.0}, estimate_cost_nanos=110_000,
                      estimate_baseline_nanos=220_000, reserved_cost_nanos=210_000,
                      reserved_baseline_nanos=420_000, owner=owner)


def _finish(call_id: str, completion: int = 7) -> LedgerEntry:
    return LedgerEntry(id=call_id, request_id="req-1", tenant_id="t1", key_id="k1", stage="direct", tier="low",
                       model="m", usage=Usage(prompt_tokens=10, completion_tokens=completion),
                       cost_nanos=10_000 + 2_000 * completion, baseline_cost_nanos=1, status="ok")


def _state(db: sessionmaker[Session]) -> tuple[list[LedgerEntryRow], int, Decimal, int]:
    """(ledger rows, open intents, daily_spend cost, daily_spend calls)."""
    with db() as s:
        rows = list(s.scalars(sa.select(LedgerEntryRow)))
        intents = s.scalar(sa.select(sa.func.count()).select_from(LedgerIntentRow)) or 0
        cost = s.scalar(sa.select(sa.func.coalesce(sa.func.sum(DailySpend.cost_usd), 0)))
        calls = s.scalar(sa.select(sa.func.coalesce(sa.func.sum(DailySpend.requests), 0)))
    return rows, intents, Decimal(cost), int(calls)


def test_intent_round_trips_through_the_journal_encoding() -> None:
    i = _intent("c1")
    assert decode_line(encode_line(i)) == i
    assert decode_line(encode_line(IntentVoid("c1"))) == IntentVoid("c1")


def test_a_row_supersedes_its_intent_and_a_replayed_intent_stays_closed(any_db: sessionmaker[Session]) -> None:
    db = any_db
    write_batch(db, [_intent("c1")])
    assert _state(db)[1] == 1
    write_batch(db, [_finish("c1")])
    assert _state(db)[1] == 0
    write_batch(db, [_intent("c1"), _finish("c1")])  # a segment replayed after its commit
    rows, intents, cost, calls = _state(db)
    assert (len(rows), intents, cost, calls) == (1, 0, Decimal("0.000024"), 1)


def test_an_intent_and_its_row_in_one_batch_close_an_intent_committed_before(any_db: sessionmaker[Session]) -> None:
    """An intent committed alone (its run died before the row), then a replayed segment that
    carries both: the intent row goes, the call is billed once. And an intent finished within
    its own batch never reaches the intents table at all."""
    db = any_db
    write_batch(db, [_intent("c1")])
    assert _state(db)[1] == 1
    write_batch(db, [_intent("c1"), _finish("c1")])
    rows, intents, cost, calls = _state(db)
    assert ([r.id for r in rows], intents, cost, calls) == (["c1"], 0, Decimal("0.000024"), 1)
    write_batch(db, [_intent("c2"), _intent("c3"), _finish("c2")])
    with db() as s:
        assert list(s.scalars(sa.select(LedgerIntentRow.id))) == ["c3"]
    assert settle_owners(db, ["o-dead"], "estimate") == 1  # c3 only: c2 has its row
    assert sorted((r.id, r.status) for r in _state(db)[0]) == [("c1", "ok"), ("c2", "ok"), ("c3", "interrupted")]


def test_a_voided_intent_bills_nothing(any_db: sessionmaker[Session]) -> None:
    db = any_db
    write_batch(db, [_intent("c1")])
    write_batch(db, [IntentVoid("c1")])
    assert settle_owners(db, ["o-dead"], "estimate") == 0
    assert _state(db) == ([], 0, Decimal(0), 0)


def test_settlement_policies_bill_the_intent_priced_at_the_call(any_db: sessionmaker[Session]) -> None:
    db = any_db
    write_batch(db, [_intent("c1"), _intent("c2", owner="o-other"), _intent("c3")])
    write_batch(db, [_finish("c3")])  # finished: not interrupted
    assert settle_owners(db, ["o-dead"], "reserved") == 1
    rows, intents, cost, calls = _state(db)
    (cut,) = [r for r in rows if r.status == "interrupted"]
    assert (cut.id, cut.prompt_tokens, cut.completion_tokens, cut.cost_usd) == ("c1", 10, 100, Decimal("0.00021"))
    assert intents == 1  # o-other's intent is not touched
    assert (cost, calls) == (Decimal("0.00021") + Decimal("0.000024"), 2)
    assert settle_owners(db, ["o-other"], "estimate") == 1
    assert _state(db)[2] == Decimal("0.00021") + Decimal("0.000024") + Decimal("0.00011")


def test_a_finishing_row_after_the_settlement_replaces_the_interrupted_row(any_db: sessionmaker[Session]) -> None:
    db = any_db
    write_batch(db, [_intent("c1")])
    settle_owners(db, ["o-dead"], "estimate")
    assert [r.status for r in _state(db)[0]] == ["interrupted"]
    write_batch(db, [_finish("c1", completion=3)])  # the call's own row turns up (e.g. another replica's replay)
    write_batch(db, [_finish("c1", completion=3)])  # and again: idempotent
    rows, intents, cost, calls = _state(db)
    assert [(r.status, r.completion_tokens, r.cost_usd) for r in rows] == [("ok", 3, Decimal("0.000016"))]
    assert (intents, cost, calls) == (0, Decimal("0.000016"), 1)  # daily_spend took the estimate back


async def test_a_ledger_stopped_with_a_call_open_leaves_it_to_the_next_start(
        tmp_path: Path, db: sessionmaker[Session]) -> None:
    root = tmp_path / "journal"
    a = Ledger(db, root, flush_interval_ms=5)
    a.start()
    call = new_entry_id()
    await a.begin(_intent(call, owner=""))
    done = new_entry_id()
    await a.begin(_intent(done, owner=""))
    a.record(_finish(done))
    assert a.health().open_intents == 1
    assert a.stop()
    assert len(list((root / ".owners").iterdir())) == 1  # kept: its open call is settled by the next start

    b = Ledger(db, root, flush_interval_ms=5, interrupted_billing="estimate")
    b.start()
    assert b.wait_settled(10)
    assert b.health().interrupted_settled == 1
    assert b.stop()
    rows, intents, _, calls = _state(db)
    assert sorted((r.id, r.status) for r in rows) == sorted([(call, "interrupted"), (done, "ok")])
    assert intents == 0 and calls == 2
    assert list((root / ".owners").iterdir()) == []


async def test_a_live_ledgers_open_calls_are_never_settled_by_another(tmp_path: Path,
                                                                      db: sessionmaker[Session]) -> None:
    root = tmp_path / "journal"
    a = Ledger(db, root, flush_interval_ms=5)
    a.start()
    call = new_entry_id()
    await a.begin(_intent(call, owner=""))
    assert await a.aflush()
    b = Ledger(db, root, flush_interval_ms=5)  # a second process on the same journal root
    b.start()
    assert b.wait_settled(10)
    assert _state(db)[0] == [] and _state(db)[1] == 1  # a is alive: its call is still in flight
    a.record(_finish(call))
    assert a.stop() and b.stop()
    rows, intents, _, _ = _state(db)
    assert [r.status for r in rows] == ["ok"] and intents == 0
