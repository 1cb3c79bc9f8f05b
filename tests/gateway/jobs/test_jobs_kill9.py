"""kill -9 of a gateway mid-batch (embedded runner), `tiergate serve` in a subprocess:

- two lines answered and two hanging upstream when it dies; after a restart, the hanging lines'
  leases expire and they run again — every line exactly once in the output and the requests
  table, the lines done before the kill are not run again, and every upstream call has exactly
  one ledger row: the killed attempts' calls ``interrupted`` (settled from their journaled
  intents), the reruns ``ok``;
- a line whose upstream call has answered but whose result has not committed (the test holds
  the database's write lock) when it dies: the call's row, written to the ledger's journal as
  the call finished, is replayed into the ledger at restart, and the line's rerun is billed
  too — two rows, one output line."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa
import yaml

from gateway.auth import generate_key, hash_key
from gateway.db import migrate
from gateway.db.models import BatchLine, DailySpend, LedgerEntryRow, Request
from gateway.db.queries import add_api_key, create_tenant
from gateway.db.session import make_engine, make_session_factory
from tests.gateway.jobs_support import batch_config, jsonl, line
from tests.gateway.ledger.test_gateway_kill9 import _free_port, _start
from tests.gateway.scripted_upstream import Behaviour, ScriptedUpstream

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.integration]

N = 8
MSGS = [{"role": "user", "content": "count"}]


def _wait_batch(client: httpx.Client, batch_id: str) -> dict:  # type: ignore[type-arg]
    for _ in range(1500):  # bounded: 1500 polls of 20 ms
        batch = client.get(f"/batches/{batch_id}").json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch  # type: ignore[no-any-return]
        time.sleep(0.02)
    raise AssertionError(f"batch not final: {batch}")


def _gateway_set_up(tmp_path: Path, upstream: ScriptedUpstream, *, concurrency: int, lease_s: float
                    ) -> tuple[Path, Any, int, Path, str, dict[str, str]]:
    """A migrated SQLite database with one tenant's key and a config for ``tiergate serve``:
    (config path, session factory, port, log path, base URL, auth header)."""
    db_url = f"sqlite:///{tmp_path / 'gw.db'}"
    cfg = batch_config(upstream.base_url, db_url, jobs={"concurrency": concurrency, "line_lease_s": lease_s},
                       journal_dir="journal")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    migrate.upgrade(db_url)
    sf = make_session_factory(make_engine(db_url))
    raw = generate_key()
    with sf() as s, s.begin():
        add_api_key(s, create_tenant(s, "acme").id, raw, hash_key(raw))
    port = _free_port()
    return config, sf, port, tmp_path / "serve.log", f"http://127.0.0.1:{port}/v1", {"Authorization": f"Bearer {raw}"}


def _restart_until_final(config: Path, port: int, log: Path, base: str, auth: dict[str, str], batch_id: str
                         ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start the gateway again, wait for the batch to be final, stop it: (batch, output lines)."""
    proc = _start(config, port, log)
    try:
        with httpx.Client(base_url=base, headers=auth, timeout=10) as client:
            batch = _wait_batch(client, batch_id)
            out = [orjson.loads(x) for x in client.get(f"/files/{batch['output_file_id']}/content").content.splitlines()]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    return batch, out


def test_kill9_mid_batch_runs_every_line_exactly_once(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    config, sf, port, log, base, auth = _gateway_set_up(tmp_path, upstream, concurrency=2, lease_s=4)
    upstream.push(Behaviour(), Behaviour(), Behaviour(block=True), Behaviour(block=True))

    proc = _start(config, port, log)
    try:
        with httpx.Client(base_url=base, headers=auth, timeout=10) as client:
            lines = [line(f"k{i}", {"model": "up-a", "messages": MSGS, "max_tokens": 1 + i}) for i in range(N)]
            f = client.post("/files", files={"file": ("in.jsonl", jsonl(lines))}, data={"purpose": "batch"}).json()
            r = client.post("/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})
            assert r.status_code == 200, r.text
            batch_id = r.json()["id"]
            assert upstream.wait_for(lambda up: len(up.requests) >= 4 and not up._script, 30), log.read_text()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    with sf() as s:
        done_before = s.scalar(sa.select(sa.func.count()).select_from(BatchLine).where(BatchLine.state == "done"))
    assert done_before == 2  # the two answered lines, committed with their results (their rows: journal or DB)

    batch, out = _restart_until_final(config, port, log, base, auth, batch_id)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": N, "completed": N, "failed": 0}
    assert [o["custom_id"] for o in out] == [f"k{i}" for i in range(N)]
    assert [o["response"]["body"]["usage"]["completion_tokens"] for o in out] == [1 + i for i in range(N)]
    assert len(upstream.requests) == N + 2  # the two killed lines ran again; the done ones did not
    with sf() as s:
        rows = list(s.scalars(sa.select(LedgerEntryRow)))
        requests = list(s.scalars(sa.select(Request)))
    sf.kw["bind"].dispose()
    assert len(rows) == len(upstream.requests)  # one row per upstream call, the killed ones too
    ok = [r for r in rows if r.status == "ok"]
    assert len(ok) == N and {r.request_id for r in ok} == {o["response"]["request_id"] for o in out}  # once each
    cut = [r for r in rows if r.status == "interrupted"]
    assert len(cut) == 2 and not {r.request_id for r in cut} & {r.request_id for r in ok}  # the killed attempts
    assert sum(r.completion_tokens for r in ok) == sum(range(1, N + 1))
    assert len(requests) == N and all(q.status == "ok" for q in requests)


def _journaled(journal: Path, request_id: str) -> bool:
    """Whether a ledger row (not just the call's intent) of ``request_id`` is in a journal segment,
    polled every 20 ms (1500 times at most)."""
    needle = f'"request_id":"{request_id}"'.encode()
    for _ in range(1500):
        for p in journal.rglob("*.jsonl"):
            if any(needle in line and b'{"t":"e",' in line for line in p.read_bytes().splitlines()):
                return True
        time.sleep(0.02)
    return False


def test_kill9_after_the_upstream_answered_bills_the_call_from_the_journal(
        tmp_path: Path, upstream: ScriptedUpstream) -> None:
    db_path = tmp_path / "gw.db"
    config, sf, port, log, base, auth = _gateway_set_up(tmp_path, upstream, concurrency=1, lease_s=3)
    answer = threading.Event()
    upstream.push(Behaviour(hold_until=answer))  # the first attempt's answer waits for the test
    writer_lock = sqlite3.connect(db_path, timeout=10, isolation_level=None)

    proc = _start(config, port, log)
    try:
        with httpx.Client(base_url=base, headers=auth, timeout=10) as client:
            lines = [line("only", {"model": "up-a", "messages": MSGS, "max_tokens": 5})]
            f = client.post("/files", files={"file": ("in.jsonl", jsonl(lines))}, data={"purpose": "batch"}).json()
            r = client.post("/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})
            assert r.status_code == 200, r.text
            batch_id = r.json()["id"]
        assert upstream.wait_for(lambda up: len(up.requests) == 1, 30), log.read_text()  # claimed, calling
        with sf() as s:
            first_id = s.scalar(sa.select(BatchLine.request_id).where(BatchLine.batch_id == batch_id))
        writer_lock.execute("BEGIN IMMEDIATE")  # from now on the line's result cannot commit
        answer.set()
        assert upstream.wait_for(lambda up: up.answered == 1, 10)
        assert _journaled(tmp_path / "journal", first_id), log.read_text()[-3000:]  # the call's row
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        writer_lock.execute("ROLLBACK")
        writer_lock.close()
    with sf() as s:  # killed between the answer and the result: nothing of the attempt in the database
        assert s.execute(sa.select(BatchLine.state, BatchLine.attempts)).one() == ("running", 1)
        assert s.scalar(sa.select(sa.func.count()).select_from(LedgerEntryRow)) == 0

    # the restart replays the journal; the lease expires and the line runs again
    batch, out = _restart_until_final(config, port, log, base, auth, batch_id)
    assert batch["status"] == "completed", batch
    assert [(o["custom_id"], o["response"]["request_id"]) for o in out] == [("only", f"{first_id}_a2")]
    assert len(upstream.requests) == 2 and upstream.answered == 2
    with sf() as s:
        rows = list(s.scalars(sa.select(LedgerEntryRow)))
        requests = {q.id: q.status for q in s.scalars(sa.select(Request))}
        spend = s.scalar(sa.select(sa.func.sum(DailySpend.requests)))
    sf.kw["bind"].dispose()
    assert sorted(r.request_id for r in rows) == [first_id, f"{first_id}_a2"]  # the killed call and the rerun
    assert all(r.status == "ok" and r.completion_tokens == 5 for r in rows) and spend == 2
    assert requests == {f"{first_id}_a2": "ok"}  # the killed attempt never reached its result commit
