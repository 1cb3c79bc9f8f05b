"""``tiergate worker``: a Celery worker process's side of batch jobs. Its ``Runtime`` (gateway.runtime), opened once
per process — database engine, ledger (replaying journal segments a dead process left), provider
registry, budgets and the classifier — on an event loop of its own thread, by the first task the
process runs, and closed when the process shuts down (the ledger last: what it cannot commit
stays journaled). Each task runs one batch to its end on it: up to ``jobs.concurrency`` lines at
once, sharing the batch with any other worker (lines are claimed in the database).

Imports the runtime, the batch logic and celery (this is a process entry point, like the routes).
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import AsyncExitStack

from celery import Celery
from celery.signals import worker_process_shutdown

from gateway.jobs.backends import build_batch_work
from gateway.jobs.celery_app import RUN_BATCH
from gateway.jobs.runner import BatchRunner
from gateway.runtime import Runtime, open_runtime
from gateway.settings import Settings


async def drain_batch(rt: Runtime, batch_id: str) -> None:
    """Run ``batch_id``'s lines in this process until the batch is final."""
    work = build_batch_work(rt.settings, rt.session_factory, rt.registry, rt.budgets, rt.decide_auto,
                            ledger=rt.ledger, decisions=rt.decisions)
    runner = BatchRunner(work, concurrency=rt.settings.jobs.concurrency,
                         poll_interval_s=rt.settings.jobs.poll_interval_s, batch_id=batch_id)
    await runner.run_until_final()


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
    """The worker's side of ``app``: the ``RUN_BATCH`` task body (take an id, run the batch on the
    process's runtime) and the runtime's close when the worker process shuts down."""

    @app.task(name=RUN_BATCH)
    def run_batch(batch_id: str) -> None:
        worker_process(settings).run_batch(batch_id)

    worker_process_shutdown.connect(lambda **_: close_worker_process(), weak=False)
