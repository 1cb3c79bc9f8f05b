"""kill -9 of a gateway mid-batch (embedded runner): `tiergate serve` in a subprocess, two lines
answered and two hanging upstream when it dies; after a restart, the hanging lines' leases
expire and they run again — every line exactly once in the output, the ledger and the
requests table, and the lines done before the kill are not run again."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import orjson
import sqlalchemy as sa
import yaml

from gateway.auth import generate_key, hash_key
from gateway.db import migrate
from gateway.db.models import LedgerEntryRow, Request
from gateway.db.queries import add_api_key, create_tenant
from gateway.db.session import make_engine, make_session_factory
from tests.gateway.jobs_support import batch_config, jsonl, line
from tests.gateway.scripted_upstream import Behaviour, ScriptedUpstream
from tests.gateway.test_gateway_kill9 import _free_port, _start

N = 8
MSGS = [{"role": "user", "content": "count"}]


def _wait_batch(client: httpx.Client, batch_id: str) -> dict:  # type: ignore[type-arg]
    for _ in range(1500):  # bounded: 1500 polls of 20 ms
        batch = client.get(f"/batches/{batch_id}").json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch  # type: ignore[no-any-return]
        time.sleep(0.02)
    raise AssertionError(f"batch not final: {batch}")


def test_kill9_mid_batch_runs_every_line_exactly_once(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    db_url = f"sqlite:///{tmp_path / 'gw.db'}"
    cfg = batch_config(upstream.base_url, db_url, jobs={"concurrency": 2, "line_lease_s": 4},
                       journal_dir="journal")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    sf = make_session_factory(engine)
    raw = generate_key()
    with sf() as s, s.begin():
        add_api_key(s, create_tenant(s, "acme").id, raw, hash_key(raw))
    port, log = _free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}/v1"
    auth = {"Authorization": f"Bearer {raw}"}
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
        done_before = s.scalar(sa.select(sa.func.count()).select_from(LedgerEntryRow))
    assert done_before == 2  # the two answered lines, committed with their results

    proc = _start(config, port, log)
    try:
        with httpx.Client(base_url=base, headers=auth, timeout=10) as client:
            batch = _wait_batch(client, batch_id)
            out = [orjson.loads(x) for x in client.get(f"/files/{batch['output_file_id']}/content").content.splitlines()]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": N, "completed": N, "failed": 0}
    assert [o["custom_id"] for o in out] == [f"k{i}" for i in range(N)]
    assert [o["response"]["body"]["usage"]["completion_tokens"] for o in out] == [1 + i for i in range(N)]
    assert len(upstream.requests) == N + 2  # the two killed lines ran again; the done ones did not
    with sf() as s:
        rows = list(s.scalars(sa.select(LedgerEntryRow)))
        requests = list(s.scalars(sa.select(Request)))
    engine.dispose()
    assert len(rows) == N and {r.request_id for r in rows} == {o["response"]["request_id"] for o in out}  # once each
    assert all(r.status == "ok" for r in rows)
    assert sum(r.completion_tokens for r in rows) == sum(range(1, N + 1))
    assert len(requests) == N and all(q.status == "ok" for q in requests)
