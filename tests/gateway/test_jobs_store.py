"""The batch line state machine on a real SQLite database: claims are exclusive, an expired
lease makes a line claimable again, and a stale attempt can neither finish the line nor bill
it (its ledger rows are written only with its result)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.db.models import Base, LedgerEntryRow
from gateway.db.session import make_engine, make_session_factory
from gateway.jobs import store
from gateway.jobs.models import BatchLine
from gateway.jobs.validate import LineSpec
from gateway.ledger.entries import LedgerEntry, new_entry_id
from gateway.providers.base import Usage

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _row(request_id: str) -> LedgerEntry:
    return LedgerEntry(id=new_entry_id(), request_id=request_id, tenant_id="t", key_id="k", stage="direct",
                       tier="low", model="m", usage=Usage(prompt_tokens=3, completion_tokens=2), cost_usd=1e-6,
                       baseline_cost_usd=2e-6)


def test_expired_lease_is_reclaimed_and_the_stale_attempt_bills_nothing(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'j.db'}")
    Base.metadata.create_all(engine)
    sf = make_session_factory(engine)
    specs = [LineSpec(1, "a", {"model": "low", "messages": []}), LineSpec(2, "b", {"model": "low", "messages": []})]
    with sf() as s, s.begin():
        batch_id = store.create_batch(s, "t", "k", "file-x", "/v1/chat/completions", "24h", None, specs, T0).id
    with sf() as s:
        first = store.claim_lines(s, now=T0, lease_s=60, limit=1)
        assert [c.custom_id for c in first] == ["a"] and first[0].attempt == 1
        assert [c.custom_id for c in store.claim_lines(s, now=T0, lease_s=60, limit=5)] == ["b"]
        assert store.claim_lines(s, now=T0 + timedelta(seconds=59), lease_s=60, limit=5) == []
        retry = store.claim_lines(s, now=T0 + timedelta(seconds=61), lease_s=60, limit=5)
        assert [(c.custom_id, c.attempt) for c in retry] == [("a", 2), ("b", 2)]
    ok = store.LineOutcome(200, {"object": "chat.completion"})
    with sf() as s, pytest.raises(store.LeaseLost), s.begin():  # the first attempt came back late
        store.finish_line(s, first[0], ok, [_row(first[0].request_id)], T0)
    with sf() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(LedgerEntryRow)) == 0
    for claim in retry:
        with sf() as s, s.begin():
            store.finish_line(s, claim, ok, [_row(claim.request_id)], T0)
    with sf() as s, pytest.raises(store.LeaseLost), s.begin():  # done is final: never finished twice
        store.finish_line(s, retry[0], ok, [_row(retry[0].request_id)], T0)
    with sf() as s:
        rows = list(s.scalars(sa.select(LedgerEntryRow)))
        assert sorted(r.request_id for r in rows) == sorted(c.request_id for c in retry)
        assert store.claim_lines(s, now=T0 + timedelta(hours=1), lease_s=60, limit=5) == []
        assert store.finalize_if_done(s, batch_id, T0) == "completed"
        assert store.finalize_if_done(s, batch_id, T0) is None  # once
        assert all(x.state == "done" for x in s.scalars(sa.select(BatchLine)))
    engine.dispose()
