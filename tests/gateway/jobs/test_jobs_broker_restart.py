"""The batch broker restarted mid-batch (a private RabbitMQ node the test stops and starts; the
machine's broker on 5672 is never touched), with two real `tiergate worker` processes and the
gateway in-process (``jobs.backend: celery``) against a scripted upstream with latency:

- batch A is running when the broker stops; the workers finish the lines they hold, reconnect
  when the broker is back, and run the rest: every line has exactly one result in the output
  file, and the upstream saw each line's call exactly once, except a line whose attempt was cut
  (then that attempt is billed ``interrupted`` and the line ran again): ledger rows = upstream
  calls, one ``ok`` row per line;
- batch B is created while the broker is down: the gateway answers 200 (the batch is in the
  database, ``validating`` with a ``queue_unavailable`` note) and enqueues it when the broker
  answers again; it completes the same way. (Before: a 503 and the batch ``failed``.)"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.jobs.celery_app import consumers, make_celery
from gateway.settings import settings_from_dict
from tests.gateway import private_rabbitmq
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
from tests.gateway.private_rabbitmq import PrivateRabbitMQ
from tests.gateway.scripted_upstream import Behaviour, ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.process, pytest.mark.slow]

N_A, N_B = 32, 6
LATENCY_S = 0.3


@pytest.fixture
def rabbit(tmp_path: Path) -> Iterator[PrivateRabbitMQ]:
    if not private_rabbitmq.available():
        pytest.skip("rabbitmq-server is not installed")
    node = PrivateRabbitMQ(tmp_path / "rabbitmq")
    node.start()
    try:
        yield node
    finally:
        node.stop()


def _worker(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "from gateway.cli import main; main()", "worker",
                             "--config", str(config), "--concurrency", "1", "--loglevel", "info",
                             "--hostname", f"t{uuid.uuid4().hex[:8]}@%h"],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


async def _until(check: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if await asyncio.to_thread(check):
                return True
        except Exception:  # the broker is still starting
            pass
        await asyncio.sleep(0.1)
    return False


def _lines(prefix: str, n: int) -> list[dict[str, Any]]:
    return [line(f"{prefix}{i}", {"model": "up-a", "messages": [{"role": "user", "content": f"{prefix}{i}"}],
                                  "max_tokens": 1 + i % 8}) for i in range(n)]


async def test_broker_restart_mid_batch_every_line_exactly_once(
        tmp_path: Path, upstream: ScriptedUpstream, rabbit: PrivateRabbitMQ, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_BROKER_URL", rabbit.url)
    jobs: dict[str, Any] = {"backend": "celery", "queue": f"tiergate-test-{uuid.uuid4().hex[:12]}", "concurrency": 2,
                           "chunk_lines": 4, "line_lease_s": 6, "requeue_interval_s": 0.5}
    config = tmp_path / "config.yaml"
    cfg = batch_config(upstream.base_url, f"sqlite:///{tmp_path / 'tiergate.db'}", jobs=jobs)
    config.write_text(yaml.safe_dump(cfg))
    celery = make_celery(settings_from_dict(cfg, base_dir=tmp_path))
    upstream.push(*[Behaviour(hang_s=LATENCY_S)] * (3 * (N_A + N_B)))
    logs = [tmp_path / "worker-a.log", tmp_path / "worker-b.log"]
    workers = [_worker(config, log) for log in logs]
    tail = lambda: "\n".join(log.read_text()[-2500:] for log in logs)  # noqa: E731
    try:
        assert await _until(lambda: consumers(celery, jobs["queue"]) == 2, 90), tail()
        async with jobs_gateway(tmp_path, upstream, jobs=jobs) as gw:
            f = (await upload(gw.client, gw.auth, jsonl(_lines("a", N_A)))).json()
            r = await create_batch(gw.client, gw.auth, f["id"])
            assert r.status_code == 200, r.text
            batch_a = r.json()["id"]
            assert await asyncio.to_thread(upstream.wait_for, lambda up: len(up.requests) >= 8, 60), tail()

            await asyncio.to_thread(rabbit.stop)  # mid-batch: lines in flight on both workers
            calls_at_stop = len(upstream.requests)
            f = (await upload(gw.client, gw.auth, jsonl(_lines("b", N_B)))).json()
            r = await create_batch(gw.client, gw.auth, f["id"])
            assert r.status_code == 200, r.text  # taken, and queued once the broker is back
            created = r.json()
            batch_b = created["id"]
            assert created["status"] == "validating"
            assert [e["code"] for e in created["errors"]["data"]] == ["queue_unavailable"]
            await asyncio.sleep(1.0)
            await asyncio.to_thread(rabbit.start)

            done_a = await wait_final(gw.client, gw.auth, batch_a, polls=4000)
            done_b = await wait_final(gw.client, gw.auth, batch_b, polls=4000)
            assert done_a["status"] == done_b["status"] == "completed", tail()
            assert done_a["request_counts"] == {"total": N_A, "completed": N_A, "failed": 0}
            assert done_b["request_counts"] == {"total": N_B, "completed": N_B, "failed": 0}
            assert done_b["errors"] is None  # the note went with the first line a worker claimed
            outputs = (await file_lines(gw.client, gw.auth, done_a["output_file_id"])
                       + await file_lines(gw.client, gw.auth, done_b["output_file_id"]))
            rows = await asyncio.to_thread(_settled_rows, gw, len(upstream.requests))
    finally:
        for w in workers:
            _stop(w)
        celery.close()

    assert calls_at_stop < N_A  # the broker really stopped mid-batch
    expected = [f"a{i}" for i in range(N_A)] + [f"b{i}" for i in range(N_B)]
    assert [o["custom_id"] for o in outputs] == expected  # one result per line, in order
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    calls = collections.Counter(r.body["messages"][0]["content"] for r in upstream.requests)
    assert set(calls) == set(expected)
    # every upstream call has exactly one ledger row; a line called twice had its first attempt cut
    assert len(rows) == len(upstream.requests), (len(rows), len(upstream.requests))
    ok = [r for r in rows if r.status == "ok"]
    assert len(ok) == len(expected)
    assert {r.request_id for r in ok} == {o["response"]["request_id"] for o in outputs}
    cut = [r for r in rows if r.status != "ok"]
    assert all(r.status == "interrupted" for r in cut), [r.status for r in cut]
    assert sum(n - 1 for n in calls.values()) == len(cut), calls


def _settled_rows(gw: Any, calls: int) -> list[Any]:
    """The ledger rows once every call's row is in the database (the workers' journals drain
    within a flush interval or two)."""
    rows: list[Any] = []
    for _ in range(100):
        rows = gw.ledger_rows()
        if len(rows) >= calls:
            return rows
        time.sleep(0.1)
    return rows
