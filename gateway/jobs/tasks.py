"""Celery task bodies: as thin as a web view — take an id, call the plain batch logic on the
process's runtime (opened by the first task, see gateway.jobs.worker). No Celery here
(celery_app registers these and closes the runtime when the worker process shuts down)."""

from __future__ import annotations

import threading

from gateway.jobs.worker import WorkerProcess
from gateway.settings import Settings

_process: WorkerProcess | None = None
_lock = threading.Lock()


def worker_process(settings: Settings) -> WorkerProcess:
    """This process's runtime, opened on first use."""
    global _process
    with _lock:
        if _process is None:
            _process = WorkerProcess(settings)
        return _process


def run_batch(settings: Settings, batch_id: str) -> None:
    """Run ``batch_id``'s lines in this worker until the batch is final."""
    worker_process(settings).run_batch(batch_id)


def close_worker_process() -> None:
    """Close this process's runtime, if a task opened one (worker process shutdown)."""
    global _process
    with _lock:
        process, _process = _process, None
    if process is not None:
        process.close()
