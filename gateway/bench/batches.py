"""`tiergate bench batches`: one batch on 1 Celery worker vs the same batch on N workers.

Against a mock upstream that answers every call after a fixed latency (``gateway.bench.tools
mock --delay-ms``), it starts the workers (`tiergate worker` subprocesses, one process each), waits
until the broker counts them as consumers of a private queue, then creates a batch of ``lines``
lines in the database (validated like ``POST /v1/batches``), enqueues its chunks the way the
gateway does (``gateway.jobs.backends.enqueue_batch``) and times it from enqueue to its final
status. Each run has its own batch; both runs share one SQLite database (or
``--database-url``), one broker and one upstream. It prints both times, the lines per second and
the ratio N-workers / 1-worker: with lines spread across workers it approaches 1/N (the
issue's target is ≤ 0.6 for 2). Worker start-up is not timed.

Bench-only: imports the jobs store and backends, the CLI's database helpers and celery.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from gateway.bench.gateway import _free_port, _tiergate_key, _wait_http

TIERS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass
class BatchBenchArgs:
    lines: int = 48
    delay_ms: float = 500.0
    workers: int = 2
    concurrency: int = 2  # jobs.concurrency: lines in flight per worker task
    chunk_lines: int = 4
    broker_url: str = "amqp://guest:guest@127.0.0.1:5672//"
    database_url: str | None = None
    timeout_s: float = 300.0


def _config(work: Path, upstream: str, args: BatchBenchArgs, queue: str) -> Path:
    model = {"provider": "openai", "model": "mock", "api_base": upstream, "context_window": 8192,
             "max_retries": 0, "price": {"input": 0.5, "output": 1.5}}
    cfg = {"server": {"log_level": "warning"},
           "database": {"url_env": "TIERGATE_BENCH_DATABASE_URL", "default_url": "sqlite:///tiergate-bench.db"},
           "ledger": {"journal_dir": "journal"},
           "models": {"mock": model},
           "tiers": {t: {"model": "mock"} for t in TIERS},
           "jobs": {"backend": "celery", "broker_url_env": "TIERGATE_BENCH_BROKER_URL", "queue": queue,
                    "concurrency": args.concurrency, "chunk_lines": args.chunk_lines, "poll_interval_s": 0.1}}
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _workers(config: Path, n: int, work: Path, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(n):
        log = (work / f"worker-{n}-{i}.log").open("ab")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "from gateway.cli import main; main()", "worker", "--config", str(config),
             "--concurrency", "1", "--loglevel", "info", "--hostname", f"bench{n}-{i}-{uuid.uuid4().hex[:6]}@%h"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _create_batch(sf: Any, lines: int) -> str:
    from gateway.db.models import ApiKey
    from gateway.jobs import store
    from gateway.jobs.files import create_file
    from gateway.jobs.validate import parse_batch_file

    body = b"\n".join(orjson.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "low", "messages": [{"role": "user", "content": f"line {i}"}],
                                             "max_tokens": 16}}) for i in range(lines))
    specs = parse_batch_file(body, "/v1/chat/completions", lines)
    with sf() as s, s.begin():
        key = s.query(ApiKey).first()
        now = store.utc_now()
        f = create_file(s, key.tenant_id, "bench.jsonl", "batch", body, now)
        return store.create_batch(s, key.tenant_id, key.id, f.id, "/v1/chat/completions", "24h", None,
                                  specs, now).id


def _run(n: int, config: Path, work: Path, env: dict[str, str], args: BatchBenchArgs, celery: Any, sf: Any,
         queue: str) -> tuple[float, dict[str, int]]:
    from gateway.jobs import store
    from gateway.jobs.backends import enqueue_batch
    from gateway.jobs.celery_app import consumers

    procs = _workers(config, n, work, env)
    try:
        deadline = time.monotonic() + 120
        while consumers(celery, queue) < n:  # every worker is up and consuming before the clock starts
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{n} worker(s) did not start; see {work}/worker-{n}-*.log")
            time.sleep(0.2)
        batch_id = _create_batch(sf, args.lines)
        started = time.monotonic()
        enqueue_batch(celery, sf, batch_id, chunk_lines=args.chunk_lines, queue=queue)
        while True:
            with sf() as s:
                status = s.get(store.Batch, batch_id).status
                if status in store.FINAL:
                    elapsed = time.monotonic() - started
                    counts = store.line_counts(s, [batch_id]).get(batch_id, {})
                    return elapsed, {"status_completed": int(status == "completed"), **counts}
            if time.monotonic() - started > args.timeout_s:
                raise RuntimeError(f"batch {batch_id} not final after {args.timeout_s} s")
            time.sleep(0.05)
    finally:
        _stop(procs)


def run_batches_bench(args: BatchBenchArgs) -> str:
    from gateway.db.session import database_url, make_engine, make_session_factory
    from gateway.jobs.celery_app import make_celery
    from gateway.settings import load_settings

    with tempfile.TemporaryDirectory(prefix="tiergate-bench-batches-") as tmp:
        work = Path(tmp)
        env = {**os.environ, "TIERGATE_BENCH_BROKER_URL": args.broker_url}
        if args.database_url:
            env["TIERGATE_BENCH_DATABASE_URL"] = args.database_url
        port = _free_port()
        mock_log = work / "mock.log"
        mock = subprocess.Popen([sys.executable, "-m", "gateway.bench.tools", "mock", "--port", str(port),
                                 "--delay-ms", str(args.delay_ms)], stdout=mock_log.open("ab"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        queue = f"tiergate-bench-{uuid.uuid4().hex[:10]}"
        try:
            _wait_http(f"http://127.0.0.1:{port}/v1/models", mock, 30, mock_log)
            config = _config(work, f"http://127.0.0.1:{port}/v1", args, queue)
            old = {k: os.environ.get(k) for k in ("TIERGATE_BENCH_BROKER_URL", "TIERGATE_BENCH_DATABASE_URL")}
            os.environ.update({k: v for k, v in env.items() if k in old})
            try:
                _tiergate_key(config)
                settings = load_settings(config)
                engine = make_engine(database_url(settings))
                sf = make_session_factory(engine)
                celery = make_celery(settings)
                results = {n: _run(n, config, work, env, args, celery, sf, queue) for n in (1, args.workers)}
                celery.close()
                engine.dispose()
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(mock.pid, signal.SIGKILL)
            mock.wait(10)
    one, many = results[1][0], results[args.workers][0]
    ideal = args.lines * args.delay_ms / 1000 / args.concurrency
    out = [f"tiergate bench batches: {args.lines} lines, upstream latency {args.delay_ms:.0f} ms, "
           f"jobs.concurrency {args.concurrency}, chunk_lines {args.chunk_lines}, one process per worker",
           f"  (a worker's floor: {ideal:.2f} s for the batch; numbers taken on this machine, which may be busy)"]
    for n in (1, args.workers):
        elapsed, counts = results[n]
        out.append(f"  {n} worker(s): {elapsed:7.2f} s  {args.lines / elapsed:7.1f} lines/s  "
                   f"completed {counts.get('completed', 0)}/{args.lines}, failed {counts.get('failed', 0)}")
    ratio = many / one
    verdict = "meets" if ratio <= 0.6 else "misses"
    out.append(f"  ratio {args.workers} workers / 1 worker: {ratio:.2f}  ({verdict} the ≤ 0.6 target for 2 workers; "
               f"ideal {1 / args.workers:.2f})")
    return "\n".join(out)
