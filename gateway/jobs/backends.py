"""Where batch lines run: wiring for the two ``jobs.backend`` settings.

- ``embedded`` (default): ``start_jobs`` starts a ``BatchRunner`` in the gateway's event loop
  for the app's lifetime; creating a batch wakes it.
- ``celery``: creating a batch enqueues one ``tiergate.run_chunk(batch_id, first, last)`` task per
  ``jobs.chunk_lines`` lines; ``tiergate worker`` processes run them (``drain_chunk``: the same
  ``BatchWork`` over their own providers, budgets and database connections), so every worker on
  the queue takes chunks of one batch. When the broker cannot take the tasks (down, restarting),
  the batch is kept: it stays ``validating`` with a ``queue_unavailable`` entry in its ``errors``
  and a ``Requeuer`` tries again every ``jobs.requeue_interval_s`` until the broker takes it.
  When no worker consumes the queue, the batch says so (a ``no_worker`` entry while it is
  ``validating``); the first line a worker claims clears either note. At start-up the gateway
  enqueues the chunks of every active batch that hold a line no one is running (a gateway that
  died between creating a batch and enqueueing it leaves some; those the broker refuses then go
  to the ``Requeuer``); a chunk that is already being worked on only joins in, since lines are
  claimed in the database.

Batch lines run through their own ``ChatFlow`` whose ledger is an ``AttemptLedger`` over the
process's real ledger (the app's; a worker starts its own on ``ledger.journal_dir``, and a
worker that dies leaves its journal to be replayed by the next process that starts a ledger
there — see gateway.jobs.batch), behind the budgets but not the per-minute rate limits (a
batch is throttled by ``jobs.concurrency`` instead). Imports celery only inside the celery
branch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from gateway.budgets import BudgetRuntime
from gateway.chat.flow import DecisionSink
from gateway.chat.request import Executor
from gateway.chat.wiring import build_flow
from gateway.errors import GatewayError
from gateway.jobs import store
from gateway.jobs.batch import BatchWork
from gateway.jobs.capture import AttemptLedger, JournaledLedger
from gateway.jobs.runner import BatchRunner
from gateway.providers.registry import ProviderRegistry
from gateway.routing import DecideAuto
from gateway.settings import JobsSettings, Settings

log = logging.getLogger("tiergate.jobs")


class QueueUnavailable(GatewayError):
    """The jobs broker did not take a batch's task."""

    status, type, code = 503, "server_error", "queue_unavailable"


@dataclass
class JobsBackend:
    # a batch was created: run it. False: it is kept and queued later (its ``errors`` say why)
    submit: Callable[[str], Awaitable[bool]]
    runner: BatchRunner | None = None  # the embedded runner
    requeuer: Requeuer | None = None  # celery: the batches the broker did not take yet


class Requeuer:
    """The batches a broker did not take (it was down or restarting): each is enqueued again,
    oldest first, every ``interval_s`` until the broker takes it. In-process (a gateway that dies
    meanwhile leaves them to the next one's start-up requeue: they are active batches with lines
    no one runs)."""

    def __init__(self, enqueue: Callable[[str], Awaitable[None]], interval_s: float) -> None:
        self._enqueue, self.interval_s = enqueue, interval_s
        self._pending: dict[str, None] = {}  # insertion-ordered set
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> list[str]:
        return list(self._pending)

    def add(self, batch_id: str) -> None:
        self._pending[batch_id] = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="tiergate-batch-requeuer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def retry_once(self) -> list[str]:
        """Enqueue the pending batches, oldest first, until the broker refuses one; returns
        those it took."""
        taken = []
        for batch_id in list(self._pending):
            try:
                await self._enqueue(batch_id)
            except QueueUnavailable:
                break
            del self._pending[batch_id]
            taken.append(batch_id)
            log.info("batch %s: queued now that the broker takes tasks again", batch_id)
        return taken

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self._pending:
                try:
                    await self.retry_once()
                except Exception as err:  # the database: try again next round
                    log.error("re-enqueueing batches failed: %s", type(err).__name__)


def build_batch_work(settings: Settings, session_factory: sessionmaker[Session], registry: ProviderRegistry,
                     budget_runtime: BudgetRuntime, decide_auto: DecideAuto | None, *, ledger: JournaledLedger,
                     pipelined: Executor | None = None, decisions: DecisionSink | None = None) -> BatchWork:
    capture = AttemptLedger(ledger)
    flow = build_flow(settings, registry, capture, budget_runtime, session_factory, decide_auto=decide_auto,
                      pipelined=pipelined, batch=True, decisions=decisions)
    return BatchWork(flow, capture, session_factory, lease_s=settings.jobs.line_lease_s)


async def start_jobs(settings: Settings, stack: AsyncExitStack, *, session_factory: sessionmaker[Session],
                     registry: ProviderRegistry, budget_runtime: BudgetRuntime, decide_auto: DecideAuto | None,
                     ledger: JournaledLedger, pipelined: Executor | None = None,
                     decisions: DecisionSink | None = None) -> JobsBackend:
    """The backend for the app's lifespan; stopped (lines in flight handed back) by ``stack``.
    ``ledger``: the app's, started before and stopped after this backend."""
    if settings.jobs.backend == "celery":
        from gateway.jobs.celery_app import make_celery

        celery = make_celery(settings)
        stack.callback(celery.close)

        async def enqueue(batch_id: str) -> None:
            await asyncio.to_thread(enqueue_batch, celery, session_factory, batch_id,
                                    chunk_lines=settings.jobs.chunk_lines, queue=settings.jobs.queue)

        requeuer = Requeuer(enqueue, settings.jobs.requeue_interval_s)

        async def submit(batch_id: str) -> bool:
            try:
                await enqueue(batch_id)
            except QueueUnavailable as err:
                log.warning("batch %s: %s; queued when the broker takes tasks again", batch_id, err.message)
                await asyncio.to_thread(_note_queue_unavailable, session_factory, batch_id, settings.jobs)
                requeuer.add(batch_id)
                return False
            return True

        await asyncio.to_thread(finalize_settled, session_factory)
        await requeue_runnable(session_factory, enqueue, requeuer)
        requeuer.start()
        stack.push_async_callback(requeuer.stop)
        return JobsBackend(submit, requeuer=requeuer)
    work = build_batch_work(settings, session_factory, registry, budget_runtime, decide_auto, ledger=ledger,
                            pipelined=pipelined, decisions=decisions)
    runner = BatchRunner(work, concurrency=settings.jobs.concurrency, poll_interval_s=settings.jobs.poll_interval_s)
    runner.start()
    stack.push_async_callback(runner.stop)

    async def wake(_: str) -> bool:
        runner.wake()
        return True

    return JobsBackend(wake, runner)


def enqueue_batch(celery: Any, session_factory: sessionmaker[Session], batch_id: str, *, chunk_lines: int,
                  queue: str) -> int:
    """Send one ``RUN_CHUNK`` task per chunk of ``batch_id`` that holds a line no one is running
    (every chunk of a new batch); then, if no worker consumes ``queue``, note it on the batch.
    Returns the tasks sent; raises ``QueueUnavailable`` when the broker does not take them."""
    from gateway.jobs.celery_app import RUN_CHUNK, consumers

    with session_factory() as session:
        chunks = store.chunk_ranges(session, batch_id, chunk_lines, runnable_at=store.utc_now())
    try:
        with celery.producer_or_acquire() as producer:
            for first, last in chunks:
                celery.send_task(RUN_CHUNK, args=[batch_id, first, last], producer=producer)
    except Exception as err:  # kombu's OperationalError, OSError, ...: the tasks are not queued
        raise QueueUnavailable(f"The batch queue is unavailable ({type(err).__name__}); "
                               f"batch {batch_id} was not started.") from err
    try:
        workers = consumers(celery, queue)
    except Exception as err:  # the tasks are queued; only the check failed
        log.warning("batch %s: could not count the workers on queue %s: %s", batch_id, queue, type(err).__name__)
        return len(chunks)
    if workers == 0:
        log.warning("batch %s: no worker consumes queue %s; it starts when one does", batch_id, queue)
        with session_factory() as session:
            store.note_no_worker(session, batch_id, f"No tiergate worker is consuming the batch queue '{queue}': "
                                 "the batch stays in 'validating' until one starts "
                                 "(`tiergate worker --config config.yaml`).")
    return len(chunks)


def _note_queue_unavailable(session_factory: sessionmaker[Session], batch_id: str, jobs: JobsSettings) -> None:
    with session_factory() as session:
        store.note_waiting(session, batch_id, store.QUEUE_UNAVAILABLE,
                           f"The batch queue (broker) is unavailable: the batch is kept and queued when the "
                           f"broker takes tasks again (tried every {jobs.requeue_interval_s:g} s).")


def finalize_settled(session_factory: sessionmaker[Session]) -> list[str]:
    """Finalize every open batch with no line left to run (a worker that died between its last
    line and the batch's finalization leaves one); returns those finalized."""
    done = []
    for batch_id in _open_ids(session_factory):
        with session_factory() as session:
            if store.finalize_if_done(session, batch_id, store.utc_now()):
                done.append(batch_id)
    return done


def _open_ids(session_factory: sessionmaker[Session]) -> list[str]:
    with session_factory() as session:
        return store.open_batch_ids(session)


async def requeue_runnable(session_factory: Any, enqueue: Callable[[str], Awaitable[None]],
                           requeuer: Requeuer | None = None) -> list[str]:
    """Enqueue every active batch with a line no one is running; returns those enqueued. A broker
    that is down is logged; the batches not enqueued go to ``requeuer`` (without one they stay
    as they are until the next start)."""
    def runnable() -> list[str]:
        with session_factory() as session:
            return store.runnable_batch_ids(session, store.utc_now())

    queued: list[str] = []
    ids = await asyncio.to_thread(runnable)
    for i, batch_id in enumerate(ids):
        try:
            await enqueue(batch_id)
        except QueueUnavailable as err:
            log.error("batch %s not re-enqueued at start-up: %s", batch_id, err.message)
            if requeuer is not None:
                for later in ids[i:]:
                    requeuer.add(later)
            break
        queued.append(batch_id)
    return queued
