"""``AttemptLedger`` over a real ledger: call rows go to the journal at once (and a wait never
settles for less than written), request records stay with the attempt until its result commit."""

from __future__ import annotations

from pathlib import Path

from gateway.db.models import Base
from gateway.db.session import make_engine, make_session_factory
from gateway.jobs.capture import AttemptLedger
from gateway.ledger import Ledger, LedgerEntry, RequestRecord, new_entry_id
from gateway.ledger.journal import read_segment
from gateway.providers.base import Usage


async def test_rows_are_journaled_request_records_are_held(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'c.db'}")
    Base.metadata.create_all(engine)
    ledger = Ledger(make_session_factory(engine), tmp_path / "journal", flush_interval_ms=60_000)
    ledger.start()
    try:
        capture = AttemptLedger(ledger)
        row = LedgerEntry(id=new_entry_id(), request_id="batch_req_x_1", tenant_id="t", key_id="k", stage="direct",
                          tier="low", model="m", usage=Usage(prompt_tokens=3, completion_tokens=2), cost_nanos=1_000,
                          baseline_cost_nanos=2_000)
        rec = RequestRecord(id="batch_req_x_1", tenant_id="t", key_id="k", requested_model="low", status="ok")
        capture.record(row)
        capture.record_request(rec)
        await capture.wait_durable("none")  # a batch line never waits for less than "written"
        assert ledger.health().records_written == 1  # the row; the request record is not the ledger's yet
        journaled = [r for p in sorted((tmp_path / "journal").rglob("*.jsonl")) for r in read_segment(p).records]
        assert journaled == [row]
        assert capture.pending() == 1
        assert capture.take_request("batch_req_x_1") == rec
        assert capture.take_request("batch_req_x_1") is None and capture.pending() == 0
    finally:
        assert ledger.stop()
        engine.dispose()
