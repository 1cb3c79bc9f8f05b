"""The batch line state machine on a real SQLite database: claims are exclusive, an expired
lease makes a line claimable again, each attempt has its own request id, the first attempt to
finish a line keeps its result, and every attempt's request is recorded once — a late one as a
superseded request. The result commit writes no ledger rows (those are the journal's)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from gateway.db.models import Base, Batch, BatchLine, DailySpend, FileObject, LedgerEntryRow, Request
from gateway.db.session import make_engine, make_session_factory
from gateway.jobs import store
from gateway.jobs.validate import LineSpec
from gateway.ledger.entries import RequestRecord

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _request(request_id: str) -> RequestRecord:
    """What one attempt hands to its result commit: its request record (its call rows went to the
    ledger's journal as the calls finished, not through the store)."""
    return RequestRecord(id=request_id, tenant_id="t", key_id="k", requested_model="low", status="ok",
                         http_status=200, cost_nanos=1_000, baseline_cost_nanos=2_000)


def _statuses(s: Session) -> dict[str, str]:
    return {rid: status for rid, status in s.execute(sa.select(Request.id, Request.status))}


def _db(tmp_path: Path) -> tuple[sa.Engine, sessionmaker[Session]]:
    engine = make_engine(f"sqlite:///{tmp_path / 'j.db'}")
    Base.metadata.create_all(engine)
    return engine, make_session_factory(engine)


def test_expired_lease_is_reclaimed_and_every_attempt_is_billed_once(tmp_path: Path) -> None:
    engine, sf = _db(tmp_path)
    specs = [LineSpec(1, "a", {"model": "low", "messages": []}), LineSpec(2, "b", {"model": "low", "messages": []})]
    with sf() as s, s.begin():
        batch_id = store.create_batch(s, "t", "k", "file-x", "/v1/chat/completions", "24h", None, specs, T0).id
    with sf() as s:
        first = store.claim_lines(s, now=T0, lease_s=60, limit=1)
        assert [c.custom_id for c in first] == ["a"] and first[0].attempt == 1
        line_a = s.scalar(sa.select(BatchLine.request_id).where(BatchLine.custom_id == "a"))
        assert first[0].request_id == line_a  # the first attempt runs under the line's own id
        assert [c.custom_id for c in store.claim_lines(s, now=T0, lease_s=60, limit=5)] == ["b"]
        assert store.claim_lines(s, now=T0 + timedelta(seconds=59), lease_s=60, limit=5) == []
        retry = store.claim_lines(s, now=T0 + timedelta(seconds=61), lease_s=60, limit=5)
        assert [(c.custom_id, c.attempt) for c in retry] == [("a", 2), ("b", 2)]
        assert retry[0].request_id == f"{line_a}_a2"  # a retry has its own
    ok = store.LineOutcome(200, {"object": "chat.completion"})
    with sf() as s, s.begin():  # the first attempt of a comes back late, but first: it finishes the line
        assert store.finish_line(s, first[0], ok, _request(first[0].request_id), T0) is True
    with sf() as s, s.begin():  # the retry of a finishes second: billed, superseded, result not kept
        assert store.finish_line(s, retry[0], store.LineOutcome(200, {"late": True}), _request(retry[0].request_id),
                                 T0) is False
    with sf() as s, s.begin():
        assert store.finish_line(s, retry[1], ok, _request(retry[1].request_id), T0) is True
    with sf() as s, s.begin():  # the same attempt's result committed twice: still one superseded request
        assert store.finish_line(s, retry[0], ok, _request(retry[0].request_id), T0) is False
    with sf() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(LedgerEntryRow)) == 0  # the journal's job
        assert s.scalar(sa.select(sa.func.count()).select_from(DailySpend)) == 0
        assert s.scalar(sa.select(sa.func.count()).select_from(Request)) == 3
        statuses = _statuses(s)
        assert statuses == {first[0].request_id: "ok", retry[0].request_id: store.SUPERSEDED,
                            retry[1].request_id: "ok"}
        assert store.claim_lines(s, now=T0 + timedelta(hours=1), lease_s=60, limit=5) == []
        assert store.finalize_if_done(s, batch_id, T0) == "completed"
        assert store.finalize_if_done(s, batch_id, T0) is None  # once
        lines = {x.custom_id: x for x in s.scalars(sa.select(BatchLine))}
        assert all(x.state == "done" for x in lines.values())
        assert lines["a"].response == {"object": "chat.completion"}  # the first finished result
        assert lines["a"].result_request_id == first[0].request_id
        assert lines["b"].result_request_id == retry[1].request_id
        out = s.scalar(sa.select(FileObject.content).join(Batch, Batch.output_file_id == FileObject.id))
    assert out is not None
    results = [orjson.loads(x) for x in out.splitlines()]
    assert [(r["custom_id"], r["id"], r["response"]["request_id"]) for r in results] == [
        ("a", line_a, first[0].request_id), ("b", retry[1].request_id.removesuffix("_a2"), retry[1].request_id)]
    engine.dispose()


def test_an_interrupted_attempt_is_billed_whether_or_not_it_owns_the_line(tmp_path: Path) -> None:
    engine, sf = _db(tmp_path)
    specs = [LineSpec(1, "a", {"model": "low", "messages": []})]
    with sf() as s, s.begin():
        store.create_batch(s, "t", "k", "file-x", "/v1/chat/completions", "24h", None, specs, T0)
    with sf() as s:
        stale = store.claim_lines(s, now=T0, lease_s=60, limit=5)[0]
        owner = store.claim_lines(s, now=T0 + timedelta(seconds=61), lease_s=60, limit=5)[0]
    with sf() as s, s.begin():  # shutdown cancels the stale attempt: the line stays the owner's
        store.release_line(s, stale, _request(stale.request_id))
    with sf() as s:
        assert s.scalar(sa.select(BatchLine.state)) == "running"
        assert s.scalar(sa.select(BatchLine.attempts)) == 2
    with sf() as s, s.begin():  # the owner is cancelled too: the line goes back to pending
        store.release_line(s, owner, _request(owner.request_id))
    with sf() as s:
        assert s.scalar(sa.select(BatchLine.state)) == "pending"
        assert _statuses(s) == {
            stale.request_id: store.SUPERSEDED, owner.request_id: "ok"}
        assert s.scalar(sa.select(sa.func.count()).select_from(LedgerEntryRow)) == 0
        again = store.claim_lines(s, now=T0 + timedelta(seconds=62), lease_s=60, limit=5)
        assert [(c.attempt, c.request_id) for c in again] == [(3, f"{stale.request_id}_a3")]
    engine.dispose()


def test_a_queue_unavailable_note_keeps_the_batch_until_a_worker_claims_a_line(tmp_path: Path) -> None:
    engine, sf = _db(tmp_path)
    specs = [LineSpec(1, "a", {"model": "low", "messages": []})]
    with sf() as s, s.begin():
        waiting = store.create_batch(s, "t", "k", "file-x", "/v1/chat/completions", "24h", None, specs, T0).id
        started = store.create_batch(s, "t", "k", "file-y", "/v1/chat/completions", "24h", None, specs, T0).id
    with sf() as s:
        both = sorted([waiting, started])  # same created_at: by id
        assert store.runnable_batch_ids(s, T0) == both
        assert [c.batch_id for c in store.claim_lines(s, now=T0, lease_s=60, limit=1, batch_id=started)] == [started]
        assert store.runnable_batch_ids(s, T0) == [waiting]  # the started one's line has a live lease
        assert store.runnable_batch_ids(s, T0 + timedelta(seconds=61)) == both
        assert store.note_waiting(s, waiting, store.QUEUE_UNAVAILABLE, "broker down") is True
        assert store.note_waiting(s, started, store.QUEUE_UNAVAILABLE, "broker down") is False
        body = store.batch_json(store.get_batch(s, "t", waiting), None)
        assert body["status"] == "validating" and body["failed_at"] is None  # kept, not failed
        assert body["errors"] == {"object": "list", "data": [
            {"code": "queue_unavailable", "message": "broker down", "param": None, "line": None}]}
        assert store.runnable_batch_ids(s, T0) == [waiting]  # still runnable: it is queued later
        assert len(store.claim_lines(s, now=T0, lease_s=60, limit=5, batch_id=waiting)) == 1
        body = store.batch_json(store.get_batch(s, "t", waiting), None)
        assert body["status"] == "in_progress" and body["errors"] is None  # the first claim clears the note
    engine.dispose()


def _specs(n: int) -> list[LineSpec]:
    return [LineSpec(i, f"c{i}", {"model": "low", "messages": []}) for i in range(1, n + 1)]


def test_cancelled_lines_are_not_counted_as_failed(tmp_path: Path) -> None:
    """Issue 15: while a batch is ``cancelling`` (and once ``cancelled``) its never-run lines were
    counted as ``failed``; OpenAI counts only what ran."""
    engine, sf = _db(tmp_path)
    with sf() as s, s.begin():
        batch = store.create_batch(s, "t", "k", "file-x", "/v1/chat/completions", "24h", None, _specs(5), T0)
        batch_id = batch.id
    with sf() as s:
        running = store.claim_lines(s, now=T0, lease_s=60, limit=2)
    with sf() as s, s.begin():
        store.finish_line(s, running[0], store.LineOutcome(200, {"object": "chat.completion"}), None, T0)
    with sf() as s, s.begin():
        store.cancel_batch(s, store.get_batch(s, "t", batch_id), T0)
    with sf() as s:
        assert store.get_batch(s, "t", batch_id).status == "cancelling"
        assert store.line_counts(s, [batch_id])[batch_id] == {"completed": 1, "failed": 0}
    with sf() as s, s.begin():
        store.finish_line(s, running[1], store.LineOutcome(400, {"error": {"code": "bad"}},
                                                           {"code": "bad", "message": "bad"}), None, T0)
    with sf() as s:
        assert store.finalize_if_done(s, batch_id, T0) == "cancelled"
        assert store.line_counts(s, [batch_id])[batch_id] == {"completed": 1, "failed": 1}
    engine.dispose()


def test_error_file_lines_for_http_errors_carry_the_response_and_no_error(tmp_path: Path) -> None:
    """Issue 15: OpenAI's error file puts an HTTP error in ``response`` (its status and error
    body) with ``error: null``; only a line that never ran (cancelled, expired) has ``error``."""
    engine, sf = _db(tmp_path)
    with sf() as s, s.begin():
        batch_id = store.create_batch(s, "t", "k", "file-x", "/v1/chat/completions", "24h", None, _specs(2), T0).id
    with sf() as s:
        [first] = store.claim_lines(s, now=T0, lease_s=60, limit=1)
    body = {"error": {"message": "over budget", "type": "insufficient_quota", "param": None,
                      "code": "budget_exceeded"}}
    with sf() as s, s.begin():
        store.finish_line(s, first, store.LineOutcome(429, body, {"code": "budget_exceeded", "message": "x"}),
                          None, T0)
    with sf() as s, s.begin():
        store.cancel_batch(s, store.get_batch(s, "t", batch_id), T0)
    with sf() as s:
        assert store.finalize_if_done(s, batch_id, T0) == "cancelled"
        content = s.scalar(sa.select(FileObject.content).join(Batch, Batch.error_file_id == FileObject.id))
    assert content is not None
    http_error, never_ran = [orjson.loads(x) for x in content.splitlines()]
    assert http_error["error"] is None
    assert http_error["response"] == {"status_code": 429, "request_id": first.request_id, "body": body}
    assert never_ran["response"] is None and never_ran["error"]["code"] == "batch_cancelled"
    engine.dispose()


def test_heartbeats_keep_a_live_lease_and_a_dead_one_expires(tmp_path: Path) -> None:
    engine, sf = _db(tmp_path)
    with sf() as s, s.begin():
        store.create_batch(s, "t", "k", "file-x", "/v1/chat/completions", "24h", None, _specs(2), T0)
    with sf() as s:
        live, dead = store.claim_lines(s, now=T0, lease_s=30, limit=2)
        for beat in (10, 20, 30, 40):  # only the live attempt beats
            assert store.extend_leases(s, [live], T0 + timedelta(seconds=beat), 30) == 1
        retry = store.claim_lines(s, now=T0 + timedelta(seconds=45), lease_s=30, limit=5)
        assert [(c.custom_id, c.attempt) for c in retry] == [(dead.custom_id, 2)]
        assert store.extend_leases(s, [dead], T0 + timedelta(seconds=46), 30) == 0  # fenced: no longer its line
    engine.dispose()


def test_chunks_cover_the_lines_and_claims_stay_in_their_chunk(tmp_path: Path) -> None:
    engine, sf = _db(tmp_path)
    with sf() as s, s.begin():
        batch_id = store.create_batch(s, "t", "k", "file-x", "/v1/chat/completions", "24h", None, _specs(10), T0).id
    with sf() as s:
        assert store.chunk_ranges(s, batch_id, 4) == [(1, 4), (5, 8), (9, 10)]
        claimed = store.claim_lines(s, now=T0, lease_s=30, limit=10, batch_id=batch_id, line_range=(5, 8))
        assert [c.custom_id for c in claimed] == ["c5", "c6", "c7", "c8"]
        # the middle chunk runs under live leases: only the others are re-enqueued at start-up
        assert store.chunk_ranges(s, batch_id, 4, runnable_at=T0) == [(1, 4), (9, 10)]
        assert store.chunk_ranges(s, batch_id, 4, runnable_at=T0 + timedelta(seconds=31)) == [(1, 4), (5, 8), (9, 10)]
        assert store.has_unsettled(s, batch_id, (5, 8))
    with sf() as s, s.begin():
        for c in claimed:
            store.finish_line(s, c, store.LineOutcome(200, {}), None, T0)
    with sf() as s:
        assert not store.has_unsettled(s, batch_id, (5, 8)) and store.has_unsettled(s, batch_id, (1, 4))
    engine.dispose()


def test_no_worker_note_until_a_line_is_claimed(tmp_path: Path) -> None:
    engine, sf = _db(tmp_path)
    with sf() as s, s.begin():
        batch_id = store.create_batch(s, "t", "k", "file-x", "/v1/chat/completions", "24h", None, _specs(1), T0).id
    with sf() as s:
        assert store.note_no_worker(s, batch_id, "No tiergate worker is consuming the batch queue 'q'")
        body = store.batch_json(store.get_batch(s, "t", batch_id), None)
        assert body["status"] == "validating" and body["errors"]["data"][0]["code"] == "no_worker"
        store.claim_lines(s, now=T0, lease_s=30, limit=1)
        s.expire_all()
        body = store.batch_json(store.get_batch(s, "t", batch_id), None)
        assert body["status"] == "in_progress" and body["errors"] is None
        assert not store.note_no_worker(s, batch_id, "late")  # a started batch is left alone
    engine.dispose()


def test_a_cancelling_batch_with_a_dead_workers_line_is_finalised(tmp_path: Path) -> None:
    engine, sf = _db(tmp_path)
    with sf() as s, s.begin():
        batch_id = store.create_batch(s, "t", "k", "file-x", "/v1/chat/completions", "24h", None, _specs(2), T0).id
    with sf() as s:
        store.claim_lines(s, now=T0, lease_s=30, limit=1)  # its worker dies: no heartbeat, no result
    with sf() as s, s.begin():
        store.cancel_batch(s, store.get_batch(s, "t", batch_id), T0)
    with sf() as s:
        assert store.finalize_if_done(s, batch_id, T0 + timedelta(seconds=10)) is None  # lease still live
        assert store.finalize_if_done(s, batch_id, T0 + timedelta(seconds=31)) == "cancelled"
    engine.dispose()


def test_start_up_finalizes_a_batch_whose_lines_all_settled(tmp_path: Path) -> None:
    from gateway.jobs.backends import finalize_settled

    engine, sf = _db(tmp_path)
    now = store.utc_now()  # finalize_settled reads the clock: a fixed date would expire the open batch
    with sf() as s, s.begin():
        batch_id = store.create_batch(s, "t", "k", "file-x", "/v1/chat/completions", "24h", None, _specs(2), now).id
        open_id = store.create_batch(s, "t", "k", "file-y", "/v1/chat/completions", "24h", None, _specs(1), now).id
    with sf() as s:
        claims = store.claim_lines(s, now=now, lease_s=30, limit=2, batch_id=batch_id)
    with sf() as s, s.begin():  # its worker died after the last line, before finalizing
        for c in claims:
            store.finish_line(s, c, store.LineOutcome(200, {}), None, now)
    assert finalize_settled(sf) == [batch_id]
    with sf() as s:
        assert store.get_batch(s, "t", batch_id).status == "completed"
        assert store.get_batch(s, "t", open_id).status == "validating"
    engine.dispose()
