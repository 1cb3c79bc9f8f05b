"""Batch jobs on real Celery workers (``jobs.backend: celery``, RabbitMQ broker): the gateway
enqueues, `tiergate worker` subprocesses run the lines. The first worker is killed -9 (its whole
process group) with two lines answered and two hanging upstream; a second worker gets the task
back from the broker (late ack), settles the dead worker's calls in flight as ``interrupted``
(from their journaled intents), waits out its leases and finishes the batch — every line exactly
once in the output, done lines not run again, and every upstream call exactly one ledger row."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml

from gateway.db.models import BatchLine, LedgerEntryRow, Request
from tests.gateway.jobs_support import (
    batch_config,
    create_batch,
    file_lines,
    jobs_gateway,
    jsonl,
    line,
    upload,
    wait_final,
)
from tests.gateway.scripted_upstream import Behaviour, ScriptedUpstream

N = 8
MSGS = [{"role": "user", "content": "count"}]


def _worker(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "from gateway.cli import main; main()", "worker",
                             "--config", str(config), "--concurrency", "1", "--loglevel", "warning"],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _kill(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(30)


@pytest.mark.process
@pytest.mark.rabbitmq
@pytest.mark.slow
async def test_celery_worker_killed_mid_batch(tmp_path: Path, upstream: ScriptedUpstream, rabbitmq_url: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_BROKER_URL", rabbitmq_url)
    jobs = {"backend": "celery", "queue": f"tiergate-test-{uuid.uuid4().hex[:12]}", "concurrency": 2,
            "line_lease_s": 4}
    config, log = tmp_path / "config.yaml", tmp_path / "worker.log"
    config.write_text(yaml.safe_dump(batch_config(upstream.base_url, f"sqlite:///{tmp_path / 'tiergate.db'}",
                                                  jobs=jobs)))
    upstream.push(Behaviour(), Behaviour(), Behaviour(block=True), Behaviour(block=True))
    async with jobs_gateway(tmp_path, upstream, jobs=jobs) as gw:
        lines = [line(f"k{i}", {"model": "up-a", "messages": MSGS, "max_tokens": 1 + i}) for i in range(N)]
        f = (await upload(gw.client, gw.auth, jsonl(lines))).json()
        r = await create_batch(gw.client, gw.auth, f["id"])
        assert r.status_code == 200, r.text
        batch_id = r.json()["id"]
        worker = _worker(config, log)
        try:
            seen = await asyncio.to_thread(upstream.wait_for, lambda up: len(up.requests) >= 4 and not up._script, 60)
            assert seen, log.read_text()[-3000:]
        finally:
            _kill(worker, signal.SIGKILL)
        with gw.session_factory() as s:  # the answered lines' rows: in the worker's journal or already in the DB
            assert s.scalar(sa.select(sa.func.count()).select_from(BatchLine).where(BatchLine.state == "done")) == 2
        worker = _worker(config, log)  # the broker hands it the unacknowledged task
        try:
            batch = await wait_final(gw.client, gw.auth, batch_id, polls=3000)
        finally:
            _kill(worker, signal.SIGTERM)
        assert batch["status"] == "completed", log.read_text()[-3000:]
        assert batch["request_counts"] == {"total": N, "completed": N, "failed": 0}
        out = await file_lines(gw.client, gw.auth, batch["output_file_id"])
        assert [o["custom_id"] for o in out] == [f"k{i}" for i in range(N)]
        assert len(upstream.requests) == N + 2  # the killed lines ran again, the done ones did not
        with gw.session_factory() as s:
            rows = list(s.scalars(sa.select(LedgerEntryRow)))
            requests = list(s.scalars(sa.select(Request)))
        assert len(rows) == len(upstream.requests)  # one row per upstream call, the killed ones too
        ok = [r for r in rows if r.status == "ok"]
        assert len(ok) == N and {r.request_id for r in ok} == {o["response"]["request_id"] for o in out}
        assert sorted(r.status for r in rows if r not in ok) == ["interrupted", "interrupted"]
        assert sum(r.completion_tokens for r in ok) == sum(range(1, N + 1))
        assert len(requests) == N and all(q.status == "ok" for q in requests)
