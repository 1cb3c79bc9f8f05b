"""Files and Batches API through the app (scripted upstream, SQLite, real ledger and budgets):
file CRUD and tenant scoping, input validation errors in OpenAI's shape, a batch run to the end
(output lines, request counts, ledger rows and budget spend that add up), a budget that denies
lines mid-batch, cancel, an attempt slower than its lease (both attempts billed, one result), a
broker that refuses connections (the batch kept, ``validating`` with a ``queue_unavailable``
note, and queued by the requeuer once the broker takes it) and the start-up re-enqueue."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from gateway.auth import generate_key, hash_key
from gateway.db.models import LedgerEntryRow, Request
from gateway.db.queries import add_api_key, create_tenant
from gateway.jobs import store
from gateway.jobs.backends import QueueUnavailable, Requeuer, requeue_runnable
from gateway.jobs.batch import BatchWork
from gateway.jobs.validate import LineSpec
from tests.gateway.gateway_harness import make_database
from tests.gateway.jobs_support import create_batch, file_lines, jobs_gateway, jsonl, line, upload, wait_final
from tests.gateway.scripted_upstream import ADMIN_KEY, Behaviour, ScriptedUpstream

ADMIN = ADMIN_KEY
pytestmark = pytest.mark.usefixtures("admin_key")
MSGS = [{"role": "user", "content": "one two three four"}]



async def test_files_crud_and_tenant_scope(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with jobs_gateway(tmp_path, upstream) as gw:
        content = jsonl([line("a", {"model": "low", "messages": MSGS})])
        r = await upload(gw.client, gw.auth, content)
        assert r.status_code == 200, r.text
        f = r.json()
        assert f["object"] == "file" and f["id"].startswith("file-") and f["bytes"] == len(content)
        assert f["purpose"] == "batch" and f["filename"] == "in.jsonl" and isinstance(f["created_at"], int)
        assert (await gw.client.get(f"/v1/files/{f['id']}", headers=gw.auth)).json() == f
        assert (await gw.client.get(f"/v1/files/{f['id']}/content", headers=gw.auth)).content == content
        listed = (await gw.client.get("/v1/files", headers=gw.auth)).json()
        assert listed["object"] == "list" and [x["id"] for x in listed["data"]] == [f["id"]]

        with gw.session_factory() as s, s.begin():  # another tenant sees none of it
            other = create_tenant(s, "other")
            raw = generate_key()
            add_api_key(s, other.id, raw, hash_key(raw))
        them = {"Authorization": f"Bearer {raw}"}
        r = await gw.client.get(f"/v1/files/{f['id']}", headers=them)
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        assert (await gw.client.get("/v1/files", headers=them)).json()["data"] == []
        assert (await create_batch(gw.client, them, f["id"])).status_code == 404
        assert (await gw.client.delete(f"/v1/files/{f['id']}", headers=them)).status_code == 404

        r = await gw.client.delete(f"/v1/files/{f['id']}", headers=gw.auth)
        assert r.json() == {"id": f["id"], "object": "file", "deleted": True}
        assert (await gw.client.get(f"/v1/files/{f['id']}", headers=gw.auth)).status_code == 404
        assert (await gw.client.get("/v1/files")).status_code == 401

        r = await upload(gw.client, gw.auth, content, purpose="fine-tune")
        assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
        r = await gw.client.post("/v1/files", headers=gw.auth, data={"purpose": "batch"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "file"


@pytest.mark.parametrize(("lines", "param", "needle"), [
    ([b"{not json"], None, "line 1: not valid JSON"),
    ([line("a", {"model": "low", "messages": MSGS}), line("a", {"model": "low", "messages": MSGS})],
     "custom_id", "line 2"),
    ([line("a", {"model": "low", "messages": MSGS}, url="/v1/embeddings")], "url", "line 1"),
    ([{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}], "method", "line 1"),
    ([line("a", {"model": "low"})], "body.messages", "line 1"),
    ([line("a", {"model": "low", "messages": MSGS, "stream": True})], "body.stream", "line 1"),
    ([{"method": "POST", "url": "/v1/chat/completions", "body": {}}], "custom_id", "line 1"),
    ([b""], "input_file_id", "no requests"),
])
async def test_invalid_input_files_are_refused(tmp_path: Path, upstream: ScriptedUpstream, lines: list[object],
                                               param: str | None, needle: str) -> None:
    async with jobs_gateway(tmp_path, upstream) as gw:
        f = (await upload(gw.client, gw.auth, jsonl(lines))).json()
        r = await create_batch(gw.client, gw.auth, f["id"])
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and needle in err["message"]
        assert (await gw.client.get("/v1/batches", headers=gw.auth)).json()["data"] == []
        assert upstream.requests == []


async def test_invalid_batch_requests(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with jobs_gateway(tmp_path, upstream, jobs={"max_lines": 2}) as gw:
        three = jsonl([line(str(i), {"model": "low", "messages": MSGS}) for i in range(3)])
        f = (await upload(gw.client, gw.auth, three)).json()
        r = await create_batch(gw.client, gw.auth, f["id"])
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_file_id"
        r = await create_batch(gw.client, gw.auth, f["id"], completion_window="1h")
        assert r.status_code == 400 and r.json()["error"]["param"] == "completion_window"
        r = await create_batch(gw.client, gw.auth, f["id"], endpoint="/v1/embeddings")
        assert r.status_code == 400 and r.json()["error"]["param"] == "endpoint"
        r = await create_batch(gw.client, gw.auth, "file-nope")
        assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id"
        r = await gw.client.post("/v1/batches", headers=gw.auth, json={"endpoint": "/v1/chat/completions"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_file_id"
        assert (await gw.client.get("/v1/batches/batch_nope", headers=gw.auth)).status_code == 404


async def test_batch_runs_every_line_once_and_bills_it(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with jobs_gateway(tmp_path, upstream) as gw:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = await gw.client.put(f"/admin/budgets/tenants/{gw.tenant_id}", headers=admin,
                                json={"period": "day", "limit_usd": "1"})
        assert r.status_code == 200, r.text
        n = 7
        lines = [line(f"req-{i}", {"model": "low", "messages": MSGS, "max_tokens": 1 + i}) for i in range(n)]
        f = (await upload(gw.client, gw.auth, jsonl(lines))).json()
        r = await create_batch(gw.client, gw.auth, f["id"], metadata={"job": "nightly"})
        assert r.status_code == 200, r.text
        created = r.json()
        assert created["object"] == "batch" and created["id"].startswith("batch_")
        assert created["status"] == "validating" and created["request_counts"] == {"total": n, "completed": 0,
                                                                                    "failed": 0}
        batch = await wait_final(gw.client, gw.auth, created["id"])
        assert batch["status"] == "completed" and batch["metadata"] == {"job": "nightly"}
        assert batch["request_counts"] == {"total": n, "completed": n, "failed": 0}
        assert batch["error_file_id"] is None and batch["in_progress_at"] and batch["completed_at"]
        out = await file_lines(gw.client, gw.auth, batch["output_file_id"])
        assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(n)]  # input order
        for i, o in enumerate(out):
            assert o["error"] is None and o["id"].startswith("batch_req_")
            assert o["response"]["status_code"] == 200 and o["response"]["request_id"] == o["id"]
            body = o["response"]["body"]
            assert body["object"] == "chat.completion" and body["id"] == o["id"]
            assert body["model"] == "up-a"  # the model that answered (the low tier's), not the name asked for
            assert body["choices"][0]["message"]["content"] == " ".join(f"w{k}" for k in range(1 + i))
            assert body["usage"]["completion_tokens"] == 1 + i
        assert len(upstream.requests) == n

        rows = gw.ledger_rows()
        by_request = {r.request_id: r for r in rows}
        assert len(rows) == n and set(by_request) == {o["id"] for o in out}
        assert all(r.request_id.startswith("batch_req_" + created["id"].removeprefix("batch_")) for r in rows)
        assert sum(r.completion_tokens for r in rows) == sum(range(1, n + 1))
        with gw.session_factory() as s:
            requests = list(s.scalars(sa.select(Request)))
        assert len(requests) == n and all(q.status == "ok" and q.key_id for q in requests)
        status = (await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}", headers=admin)).json()["status"]
        assert Decimal(str(status["spent_usd"])) == sum((r.cost_usd for r in rows), Decimal(0)) > 0
        assert status["held_usd"] == 0

        listed = (await gw.client.get("/v1/batches", headers=gw.auth)).json()
        assert [b["id"] for b in listed["data"]] == [created["id"]] and listed["has_more"] is False
        files = (await gw.client.get("/v1/files?purpose=batch_output", headers=gw.auth)).json()["data"]
        assert [x["id"] for x in files] == [batch["output_file_id"]]
        r = await gw.client.post(f"/v1/batches/{created['id']}/cancel", headers=gw.auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_state"


async def test_budget_denies_lines_mid_batch_and_the_batch_goes_on(tmp_path: Path,
                                                                  upstream: ScriptedUpstream) -> None:
    cost = Decimal(11 * 1 + 4 * 2) / Decimal(10**6)  # worst case == actual: 11 prompt, 4 completion tokens
    exact = [{"role": "user", "content": ""}]  # the prompt bound of holds is 11 tokens, as the upstream counts
    async with jobs_gateway(tmp_path, upstream) as gw:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = await gw.client.put(f"/admin/budgets/tenants/{gw.tenant_id}", headers=admin,
                                json={"period": "day", "limit_usd": str(cost * Decimal("3.5"))})
        assert r.status_code == 200, r.text
        lines = [line(f"q{i}", {"model": "low", "messages": exact, "max_tokens": 4}) for i in range(8)]
        f = (await upload(gw.client, gw.auth, jsonl(lines))).json()
        batch = await wait_final(gw.client, gw.auth, (await create_batch(gw.client, gw.auth, f["id"])).json()["id"])
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 8, "completed": 3, "failed": 5}
        out = await file_lines(gw.client, gw.auth, batch["output_file_id"])
        errors = await file_lines(gw.client, gw.auth, batch["error_file_id"])
        assert sorted(o["custom_id"] for o in out + errors) == sorted(f"q{i}" for i in range(8))
        for e in errors:  # OpenAI's shape: an HTTP error is the response, and error is null
            assert e["error"] is None
            assert e["response"]["status_code"] == 429 and e["response"]["request_id"] == e["id"]
            assert e["response"]["body"]["error"]["type"] == "insufficient_quota"
            assert e["response"]["body"]["error"]["code"] == "budget_exceeded"
        assert len(upstream.requests) == 3  # denied lines never reached the upstream
        rows = gw.ledger_rows()
        assert len(rows) == 3 and sum((r.cost_usd for r in rows), Decimal(0)) == 3 * cost
        status = (await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}", headers=admin)).json()["status"]
        assert Decimal(str(status["spent_usd"])) == 3 * cost and status["held_usd"] == 0
        with gw.session_factory() as s:
            denied = s.scalar(sa.select(sa.func.count()).select_from(Request).where(Request.http_status == 429))
        assert denied == 5


@pytest.mark.slow
async def test_cancel_stops_new_lines_and_finalises_with_what_is_done(tmp_path: Path,
                                                                      upstream: ScriptedUpstream) -> None:
    async with jobs_gateway(tmp_path, upstream, jobs={"concurrency": 1}, timeout_s=2, max_retries=0) as gw:
        upstream.push(Behaviour(n_words=2), Behaviour(block=True))  # the 2nd line hangs until timed out
        lines = [line(f"c{i}", {"model": "up-a", "messages": MSGS}) for i in range(6)]
        f = (await upload(gw.client, gw.auth, jsonl(lines))).json()
        batch_id = (await create_batch(gw.client, gw.auth, f["id"])).json()["id"]
        assert await asyncio.to_thread(upstream.wait_for, lambda up: len(up.requests) >= 2)
        r = await gw.client.post(f"/v1/batches/{batch_id}/cancel", headers=gw.auth)
        assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
        batch = await wait_final(gw.client, gw.auth, batch_id)
        assert batch["status"] == "cancelled" and batch["cancelled_at"] and batch["cancelling_at"]
        out = await file_lines(gw.client, gw.auth, batch["output_file_id"])
        errors = await file_lines(gw.client, gw.auth, batch["error_file_id"])
        assert sorted(o["custom_id"] for o in out + errors) == [f"c{i}" for i in range(6)]  # each exactly once
        assert out[0]["custom_id"] == "c0"
        cancelled = [e for e in errors if e["error"] and e["error"]["code"] == "batch_cancelled"]
        assert cancelled and all(e["response"] is None for e in cancelled)
        ran = len(upstream.requests)
        assert ran < 6  # cancelled lines never reached the upstream
        counts = batch["request_counts"]
        assert counts["total"] == 6  # cancelled lines are neither completed nor failed
        assert counts["completed"] + counts["failed"] == 6 - len(cancelled)
        assert len(gw.ledger_rows()) == ran  # every upstream call billed once
        with gw.session_factory() as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(LedgerEntryRow)) == ran


async def _until(check: Callable[[], bool], polls: int = 500) -> bool:
    """``check()`` once it holds, polled every 20 ms (at most ``polls`` times)."""
    for _ in range(polls):
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()


async def test_an_attempt_slower_than_its_lease_is_billed_and_one_result_is_kept(
        tmp_path: Path, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    async def stalled(self: BatchWork, claims: list[Any]) -> int:  # a process whose heartbeats do not land
        return 0
    monkeypatch.setattr(BatchWork, "heartbeat", stalled)
    async with jobs_gateway(tmp_path, upstream, jobs={"line_lease_s": 0.5}) as gw:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = await gw.client.put(f"/admin/budgets/tenants/{gw.tenant_id}", headers=admin,
                                json={"period": "day", "limit_usd": "1"})
        assert r.status_code == 200, r.text
        upstream.push(Behaviour(hold_until_requests=2))  # the first attempt answers once the retry has asked
        f = (await upload(gw.client, gw.auth, jsonl([line("slow", {"model": "low", "messages": MSGS,
                                                                  "max_tokens": 3})]))).json()
        batch = await wait_final(gw.client, gw.auth, (await create_batch(gw.client, gw.auth, f["id"])).json()["id"])
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 1, "completed": 1, "failed": 0}

        def billed() -> bool:  # the attempt that lost the race may be written just after the batch completed
            return len(gw.request_rows()) == len(upstream.requests) >= 2
        assert await _until(billed), (len(gw.request_rows()), len(upstream.requests))
        out = await file_lines(gw.client, gw.auth, batch["output_file_id"])
        assert [o["custom_id"] for o in out] == ["slow"]  # one result for the line
        rows, requests = gw.ledger_rows(), gw.request_rows()
        assert len(rows) == len(requests) == len(upstream.requests)  # every attempt billed, once
        assert {r.request_id for r in rows} == {q.id for q in requests}
        assert {q.id for q in requests} >= {out[0]["id"], out[0]["id"] + "_a2"}
        kept = [q.id for q in requests if q.status == "ok"]
        assert kept == [out[0]["response"]["request_id"]]
        assert all(q.status == "superseded" for q in requests if q.id not in kept)
        assert out[0]["response"]["body"]["id"] == kept[0]
        assert all(r.completion_tokens == 3 for r in rows)
        status = (await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}", headers=admin)).json()["status"]
        assert Decimal(str(status["spent_usd"])) == sum((r.cost_usd for r in rows), Decimal(0)) > 0
        assert status["held_usd"] == 0


async def test_a_broker_that_refuses_connections_keeps_the_batch_for_later(
        tmp_path: Path, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a 503 and the batch ``failed``; the client had to create it again."""
    with socket.socket() as probe:  # a port nothing listens on: connections are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("TIERGATE_BROKER_URL", f"amqp://guest:guest@127.0.0.1:{port}//")
    async with jobs_gateway(tmp_path, upstream, jobs={"backend": "celery", "requeue_interval_s": 60}) as gw:
        f = (await upload(gw.client, gw.auth, jsonl([line("a", {"model": "low", "messages": MSGS})]))).json()
        r = await create_batch(gw.client, gw.auth, f["id"])
        assert r.status_code == 200, r.text
        batch = r.json()
        assert batch["status"] == "validating" and batch["failed_at"] is None
        [note] = batch["errors"]["data"]
        assert note["code"] == "queue_unavailable" and "queued when the broker takes tasks again" in note["message"]
        assert (await gw.client.get(f"/v1/batches/{batch['id']}", headers=gw.auth)).json() == batch
        requeuer = gw.app.state.tiergate.jobs.requeuer
        assert requeuer.pending == [batch["id"]]
        assert await requeuer.retry_once() == []  # still refused: kept
        assert requeuer.pending == [batch["id"]]
        assert upstream.requests == []


async def test_the_requeuer_enqueues_oldest_first_until_the_broker_refuses() -> None:
    refused = {"b1", "b2", "b3", "b4"}  # the broker is down
    sent: list[str] = []

    async def enqueue(batch_id: str) -> None:
        if batch_id in refused:
            raise QueueUnavailable("The batch queue is unavailable (OperationalError).")
        sent.append(batch_id)

    requeuer = Requeuer(enqueue, interval_s=0.01)
    for b in ("b1", "b2", "b3", "b4"):
        requeuer.add(b)
    assert await requeuer.retry_once() == [] and requeuer.pending == ["b1", "b2", "b3", "b4"]
    refused = {"b3", "b4"}  # the broker came back, then went away again mid-round
    assert await requeuer.retry_once() == ["b1", "b2"]  # b3 refused: the round stops, b4 waits
    assert requeuer.pending == ["b3", "b4"] and sent == ["b1", "b2"]
    refused = set()
    requeuer.start()  # the loop retries on its own
    for _ in range(200):
        if not requeuer.pending:
            break
        await asyncio.sleep(0.01)
    await requeuer.stop()
    assert requeuer.pending == [] and sent == ["b1", "b2", "b3", "b4"]


async def test_start_up_requeues_batches_no_one_is_running(tmp_path: Path) -> None:
    _, sf, tenant_id, _ = make_database(tmp_path)
    specs = [LineSpec(1, "a", {"model": "low", "messages": MSGS})]
    with sf() as s, s.begin():
        stuck = store.create_batch(s, tenant_id, None, "file-x", "/v1/chat/completions", "24h", None, specs,
                                   store.utc_now()).id
    sent: list[str] = []

    async def enqueue(batch_id: str) -> None:
        sent.append(batch_id)

    assert await requeue_runnable(sf, enqueue) == [stuck] and sent == [stuck]

    async def broker_down(batch_id: str) -> None:
        raise QueueUnavailable("The batch queue is unavailable (OperationalError).")

    assert await requeue_runnable(sf, broker_down) == []  # logged; the batch stays for the next start
    with sf() as s:
        assert store.get_batch(s, tenant_id, stuck).status == "validating"
    requeuer = Requeuer(broker_down, interval_s=60)
    assert await requeue_runnable(sf, broker_down, requeuer) == []
    assert requeuer.pending == [stuck]  # tried again until the broker takes it


async def test_an_auto_line_names_the_model_that_answered(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    """Issue 15: output bodies said ``"model": "auto"``; OpenAI's name the model that answered."""
    async with jobs_gateway(tmp_path, upstream) as gw:
        body = {"model": "auto", "reasoning_effort": "high", "messages": MSGS, "max_tokens": 2}
        f = (await upload(gw.client, gw.auth, jsonl([line("a", body)]))).json()
        batch = await wait_final(gw.client, gw.auth, (await create_batch(gw.client, gw.auth, f["id"])).json()["id"])
        [out] = await file_lines(gw.client, gw.auth, batch["output_file_id"])
        assert out["response"]["body"]["model"] == "up-high"
