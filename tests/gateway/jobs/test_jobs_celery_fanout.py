"""A batch's lines fan out over every Celery worker (RabbitMQ broker, `tiergate worker`
subprocesses, the gateway in-process with ``jobs.backend: celery``):

- with no worker on the queue the batch says so (a ``no_worker`` entry in its ``errors`` while
  ``validating``); two workers that start then both run lines of that one batch at the same time
  (each is one process running one line at a time), and the note is gone;
- a worker killed -9 mid-line: the other worker gets its chunk back from the broker and runs the
  dead worker's line once its lease (the default, 30 s: no heartbeat extends it any more) runs
  out — well within a minute — every line exactly once in the output and the ledger."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import typer
import yaml
from typer.testing import CliRunner

from gateway.cli import batches_cmd
from gateway.db.models import LedgerIntentRow
from gateway.jobs.celery_app import consumers, make_celery
from gateway.settings import JobsSettings, settings_from_dict
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

pytestmark = [pytest.mark.process, pytest.mark.rabbitmq, pytest.mark.slow]
MSGS = [{"role": "user", "content": "count"}]


def _worker(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "from gateway.cli import main; main()", "worker",
                             "--config", str(config), "--concurrency", "1", "--loglevel", "info",
                             "--hostname", f"t{uuid.uuid4().hex[:8]}@%h"],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _batches_cli() -> typer.Typer:
    root = typer.Typer()
    root.add_typer(batches_cmd.app, name="batches")
    return root


def _kill(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(30)


def _set_up(tmp_path: Path, upstream: ScriptedUpstream, rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch,
            **config: Any) -> tuple[dict[str, Any], Path, Any]:
    monkeypatch.setenv("TIERGATE_BROKER_URL", rabbitmq_url)
    jobs = {"backend": "celery", "queue": f"tiergate-test-{uuid.uuid4().hex[:12]}", "concurrency": 1,
            "chunk_lines": 2}
    path = tmp_path / "config.yaml"
    cfg = batch_config(upstream.base_url, f"sqlite:///{tmp_path / 'tiergate.db'}", jobs=jobs, **config)
    path.write_text(yaml.safe_dump(cfg))
    celery = make_celery(settings_from_dict(cfg, base_dir=tmp_path))
    return jobs, path, celery


async def _until(check: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check):
            return True
        await asyncio.sleep(0.1)
    return False


def _lines_run(log: Path, batch_id: str) -> int:
    return sum(int(n) for n in re.findall(rf"batch {batch_id} lines \d+-\d+: (\d+) lines run here", log.read_text()))


async def test_no_worker_is_said_and_two_workers_share_one_batch(
        tmp_path: Path, upstream: ScriptedUpstream, rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 12
    jobs, config, celery = _set_up(tmp_path, upstream, rabbitmq_url, monkeypatch)
    both_running = threading.Event()
    upstream.push(Behaviour(hold_until=both_running), Behaviour(hold_until=both_running),
                  *[Behaviour(hang_s=0.05)] * n)
    logs = [tmp_path / "worker-a.log", tmp_path / "worker-b.log"]
    async with jobs_gateway(tmp_path, upstream, jobs=jobs) as gw:
        lines = [line(f"k{i}", {"model": "up-a", "messages": MSGS, "max_tokens": 1 + i}) for i in range(n)]
        f = (await upload(gw.client, gw.auth, jsonl(lines))).json()
        r = await create_batch(gw.client, gw.auth, f["id"])
        assert r.status_code == 200, r.text
        batch_id = r.json()["id"]
        waiting = (await gw.client.get(f"/v1/batches/{batch_id}", headers=gw.auth)).json()
        assert waiting["status"] == "validating"
        [note] = waiting["errors"]["data"]
        assert note["code"] == "no_worker" and jobs["queue"] in note["message"]
        shown = CliRunner().invoke(_batches_cli(), ["batches", "show", batch_id, "--config", str(config)])
        assert shown.exit_code == 0 and "No tiergate worker is consuming" in shown.output, shown.output

        workers = [_worker(config, log) for log in logs]
        try:
            assert await _until(lambda: consumers(celery, jobs["queue"]) == 2, 90), logs[0].read_text()[-3000:]
            # each worker runs one line at a time: two lines held upstream at once are one on each worker
            assert await asyncio.to_thread(upstream.wait_for, lambda up: len(up.requests) >= 2, 30)
            both_running.set()
            batch = await wait_final(gw.client, gw.auth, batch_id, polls=3000)
            assert await _until(lambda: all(_lines_run(log, batch_id) for log in logs)
                                and sum(_lines_run(log, batch_id) for log in logs) == n, 30)
        finally:
            for w in workers:
                _kill(w, signal.SIGTERM)
            celery.close()
        assert batch["status"] == "completed" and batch["errors"] is None, logs[0].read_text()[-3000:]
        assert batch["request_counts"] == {"total": n, "completed": n, "failed": 0}
        out = await file_lines(gw.client, gw.auth, batch["output_file_id"])
        assert [o["custom_id"] for o in out] == [f"k{i}" for i in range(n)]
        assert len(upstream.requests) == n
        assert all(_lines_run(log, batch_id) > 0 for log in logs)  # both workers ran lines of the one batch
        assert len(gw.ledger_rows()) == n


async def test_a_killed_workers_line_runs_again_within_the_default_lease(
        tmp_path: Path, upstream: ScriptedUpstream, rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 6
    lease = JobsSettings().line_lease_s
    assert lease <= 60  # the default recovers a dead worker's lines within a minute
    slow = {"timeout_s": 120, "max_retries": 0}  # the hanging call outlives the test unless its worker dies
    jobs, config, celery = _set_up(tmp_path, upstream, rabbitmq_url, monkeypatch, **slow)
    upstream.push(Behaviour(block=True))  # line 1 hangs on the worker that is killed
    log_a, log_b = tmp_path / "worker-a.log", tmp_path / "worker-b.log"
    async with jobs_gateway(tmp_path, upstream, jobs=jobs, **slow) as gw:
        lines = [line(f"k{i}", {"model": "up-a", "messages": MSGS, "max_tokens": 1 + i}) for i in range(n)]
        f = (await upload(gw.client, gw.auth, jsonl(lines))).json()
        batch_id = (await create_batch(gw.client, gw.auth, f["id"])).json()["id"]
        a = _worker(config, log_a)
        b = None
        try:
            assert await asyncio.to_thread(upstream.wait_for, lambda up: len(up.requests) >= 1, 90), \
                log_a.read_text()[-3000:]
            b = _worker(config, log_b)
            assert await _until(lambda: consumers(celery, jobs["queue"]) == 2, 90), log_b.read_text()[-3000:]
            _kill(a, signal.SIGKILL)
            killed = time.monotonic()
            batch = await wait_final(gw.client, gw.auth, batch_id, polls=int((lease + 30) / 0.02))
            recovered_s = time.monotonic() - killed
        finally:
            _kill(a, signal.SIGKILL)
            if b is not None:
                _kill(b, signal.SIGTERM)
            celery.close()
        assert batch["status"] == "completed", log_b.read_text()[-3000:]
        assert recovered_s < lease + 30, recovered_s  # one lease after the dead worker's last heartbeat
        assert batch["request_counts"] == {"total": n, "completed": n, "failed": 0}
        out = await file_lines(gw.client, gw.auth, batch["output_file_id"])
        assert [o["custom_id"] for o in out] == [f"k{i}" for i in range(n)]
        assert out[0]["response"]["request_id"].endswith("_a2")  # line 1 ran again, as a second attempt
        assert len(upstream.requests) == n + 1  # only the killed line ran twice
        rows = gw.ledger_rows()
        ok = [r for r in rows if r.status == "ok"]
        assert len(ok) == n and {r.request_id for r in ok} == {o["response"]["request_id"] for o in out}
        # the killed call: an ``interrupted`` row once a ledger started after the kill settled its
        # intent (worker b's, when b opened its runtime after the kill), else its intent is still open
        with gw.session_factory() as s:
            open_intents = s.scalar(sa.select(sa.func.count()).select_from(LedgerIntentRow))
        assert [r.status for r in rows if r not in ok] in ([], ["interrupted"])
        assert len(rows) + open_intents == len(upstream.requests)
