"""``tiergate worker``: a Celery worker process's side of batch jobs. Its ``Runtime`` (gateway.runtime), opened once
per process — database engine, ledger (replaying journal segments a dead process left), provider
registry, budgets and the classifier — on an event loop of its own thread, by the first task the
process runs, and closed when the process shuts down (the ledger last: what it cannot commit
stays journaled). Each ``RUN_CHUNK`` task runs one chunk of a batch (a range of its lines, at most
``jobs.chunk_lines``) to its end on it, up to ``jobs.concurrency`` lines at once: a batch's chunks
are separate tasks, so every worker on the queue takes a share of one batch (lines are claimed
in the database, fenced, so a chunk task that is delivered twice only joins in). Each chunk logs
its start and end with the batch's progress (``tiergate.jobs``, INFO). ``RUN_BATCH`` (one task
for a whole batch, what older gateways sent) still works: it joins in on every line.

Imports the runtime, the batch logic and celery (this is a process entry point, like the routes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from contextlib import AsyncExitStack

from celery import Celery
from celery.signals import worker_process_shutdown

from gateway.jobs.backends import build_batch_work
from gateway.jobs.celery_app import RUN_BATCH, RUN_CHUNK
from gateway.jobs.runner import BatchRunner
from gateway.runtime import Runtime, open_runtime
from gateway.settings import Settings

log = logging.getLogger("tiergate.jobs")


async def drain_batch(rt: Runtime, batch_id: str) -> None:
    """Run ``batch_id``'s lines in this process until the batch is final."""
    work = build_batch_work(rt.settings, rt.session_factory, rt.registry, rt.budgets, rt.decide_auto,
                            ledger=rt.ledger, decisions=rt.decisions)
    runner = BatchRunner(work, concurrency=rt.settings.jobs.concurrency,
                         poll_interval_s=rt.settings.jobs.poll_interval_s, batch_id=batch_id)
    await runner.run_until_final()


async def drain_chunk(rt: Runtime, batch_id: str, first: int, last: int) -> int:
    """Run ``batch_id``'s lines ``first``..``last`` (line numbers) in this process until each is
    settled; returns how many lines this process ran. Logs the chunk and the batch's progress."""
    work = build_batch_work(rt.settings, rt.session_factory, rt.registry, rt.budgets, rt.decide_auto,
                            ledger=rt.ledger, decisions=rt.decisions)
    runner = BatchRunner(work, concurrency=rt.settings.jobs.concurrency,
                         poll_interval_s=rt.settings.jobs.poll_interval_s, batch_id=batch_id,
                         line_range=(first, last))
    started = time.monotonic()
    log.info("batch %s lines %d-%d: started (pid %d)", batch_id, first, last, os.getpid())
    await runner.run_until_settled()
    p = await work.progress(batch_id)
    settled = p["done"] + p["cancelled"] + p["expired"]
    total = settled + p["pending"] + p["running"]
    log.info("batch %s lines %d-%d: %d lines run here in %.1f s (pid %d); batch %d/%d settled, "
             "%d ok, %d failed, %d cancelled, %d running", batch_id, first, last, runner.lines_run,
             time.monotonic() - started, os.getpid(), settled, total, p["done"] - p["failed"], p["failed"],
             p["cancelled"], p["running"])
    return runner.lines_run


class WorkerProcess:
    """The process's runtime on a private event loop; ``run_batch`` is called from Celery's
    (synchronous) task threads."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tiergate-worker-loop", daemon=True)
        self._thread.start()
        self._stack = AsyncExitStack()
        self.runtime: Runtime = self._call(self._open())

    async def _open(self) -> Runtime:
        return await self._stack.enter_async_context(open_runtime(self.settings, role="worker"))

    def _call(self, coro: object) -> Runtime:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def run_batch(self, batch_id: str) -> None:
        asyncio.run_coroutine_threadsafe(drain_batch(self.runtime, batch_id), self._loop).result()

    def run_chunk(self, batch_id: str, first: int, last: int) -> int:
        return asyncio.run_coroutine_threadsafe(drain_chunk(self.runtime, batch_id, first, last),
                                                self._loop).result()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stack.aclose(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()


# -- the Celery side: task bodies as thin as a web view ---------------------------------------
_process: WorkerProcess | None = None
_lock = threading.Lock()


def worker_process(settings: Settings) -> WorkerProcess:
    """This process's runtime, opened on first use."""
    global _process
    with _lock:
        if _process is None:
            _process = WorkerProcess(settings)
        return _process


def close_worker_process() -> None:
    """Close this process's runtime, if a task opened one (worker process shutdown)."""
    global _process
    with _lock:
        process, _process = _process, None
    if process is not None:
        process.close()


def register_tasks(app: Celery, settings: Settings) -> None:
    """The worker's side of ``app``: the ``RUN_CHUNK`` task body (take a batch id and a line
    range, run those lines on the process's runtime), ``RUN_BATCH`` (a whole batch) and the
    runtime's close when the worker process shuts down."""

    @app.task(name=RUN_CHUNK)
    def run_chunk(batch_id: str, first: int, last: int) -> int:
        return worker_process(settings).run_chunk(batch_id, int(first), int(last))

    @app.task(name=RUN_BATCH)
    def run_batch(batch_id: str) -> None:
        worker_process(settings).run_batch(batch_id)

    worker_process_shutdown.connect(lambda **_: close_worker_process(), weak=False)
