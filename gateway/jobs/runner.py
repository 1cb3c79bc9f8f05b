"""``BatchRunner``: an asyncio loop that keeps up to ``concurrency`` batch lines in flight.

It claims runnable lines (of every batch, of one, or of one chunk of one: a line-number range),
runs each as a task, finalizes a batch when its last line settles, and sleeps until woken (a
batch was created) or ``poll_interval_s`` passes (a lease may have expired, another process may
have added work). While lines are in flight a heartbeat extends their leases every third of
``BatchWork.lease_s``, so a live attempt keeps its line however long its call takes and a dead
process's lines are claimable again one lease after its last heartbeat. The embedded backend runs
one per gateway process for its lifetime (``start``/``stop``); a Celery task runs one for a
chunk of a batch until every line of the chunk is settled (``run_until_settled``). Errors in the
loop are logged and retried after the poll interval; they never kill it. Progress is logged at
INFO on the ``tiergate.jobs`` logger. Imports jobs.batch only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.jobs.batch import BatchWork
from gateway.jobs.store import ClaimedLine, LineRange
from gateway.log_safety import describe

log = logging.getLogger("tiergate.jobs")


class BatchRunner:
    def __init__(self, work: BatchWork, *, concurrency: int, poll_interval_s: float,
                 batch_id: str | None = None, line_range: LineRange | None = None) -> None:
        self.work, self.concurrency, self.poll_interval_s = work, concurrency, poll_interval_s
        self.batch_id, self.line_range = batch_id, line_range
        self._inflight: set[asyncio.Task[None]] = set()
        self._claims: dict[asyncio.Task[None], ClaimedLine] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self.lines_run = 0  # lines this runner ran to a result (kept or superseded)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="tiergate-batch-runner")
        self._beat = asyncio.create_task(self._heartbeat(), name="tiergate-batch-heartbeat")

    async def _heartbeat(self) -> None:
        """Every third of a lease, extend the leases of the lines in flight."""
        while True:
            await asyncio.sleep(self.work.lease_s / 3)
            claims = list(self._claims.values())
            if not claims:
                continue
            try:
                await self.work.heartbeat(claims)
            except Exception as err:  # the database may be briefly away: the next beat tries again
                log.error("batch runner: lease heartbeat failed: %s", describe(err))

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        """Stop claiming; lines in flight are cancelled and handed back (billed for what they spent)."""
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # stop() itself was cancelled, not just the loop it ended
        await self._cancel_inflight()

    async def run_until_final(self) -> None:
        """Work on ``batch_id`` until it is final (other processes may be working on it too)."""
        assert self.batch_id is not None
        await self._run_while(lambda: self.work.is_open(self.batch_id))  # type: ignore[arg-type]

    async def run_until_settled(self) -> None:
        """Work on ``batch_id``'s lines in ``line_range`` until none of them is pending or running
        (or the batch is no longer open). A line of the range that another live process runs is
        waited for: its lease runs out if that process dies, and this runner claims it then."""
        assert self.batch_id is not None
        batch_id, line_range = self.batch_id, self.line_range
        await self._run_while(lambda: self.work.has_unsettled(batch_id, line_range))
        for attempt in range(5):  # the last chunk to settle finalizes the batch (a no-op for the others)
            try:
                await self.work.finalize(batch_id)
                return
            except Exception as err:  # a gateway's start-up finalizes it if this never gets through
                log.error("batch %s not finalized (attempt %d): %s", batch_id, attempt + 1, describe(err))
                await asyncio.sleep(self.poll_interval_s * (attempt + 1))

    async def _run_while(self, more: Callable[[], Awaitable[bool]]) -> None:
        async def more_or_retry() -> bool:
            try:
                return await more()
            except Exception as err:  # the database may be briefly away: keep the work, look again
                log.error("batch runner: %s", describe(err))
                await asyncio.sleep(self.poll_interval_s)
                return True

        self._beat = asyncio.create_task(self._heartbeat(), name="tiergate-batch-heartbeat")
        try:
            while self._inflight or await more_or_retry():
                await self._tick()
        finally:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
            await self._cancel_inflight()

    async def _cancel_inflight(self) -> None:
        for task in list(self._inflight):
            task.cancel()
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self._tick()

    async def _tick(self) -> None:
        claimed: list[ClaimedLine] = []
        try:
            free = self.concurrency - len(self._inflight)
            if free > 0:
                claimed = await self._claim(free)
                for claim in claimed:
                    task = asyncio.create_task(self._run(claim))
                    self._inflight.add(task)
                    self._claims[task] = claim
                    task.add_done_callback(self._forget)
            if not claimed and not self._inflight:
                await (self.work.finalize(self.batch_id) if self.batch_id else self.work.sweep())
        except Exception as err:  # the database may be briefly away: log, wait, try again
            log.error("batch runner: %s", describe(err))
        if not claimed:
            # asyncio.timeout, not wait_for: on Python 3.11 a wait_for whose inner wait finishes as the task
            # is cancelled returns the result and drops the cancel (`stop` then waited on a loop that went
            # on ticking, for ever: seen under load when a finished line set the wake just as stop came)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval_s):
                    await self._wake.wait()
            self._wake.clear()

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._claims.pop(task, None)

    async def _claim(self, limit: int) -> list[ClaimedLine]:
        """Claim lines; if this runner is stopped meanwhile, the claimed lines are handed back."""
        pending = asyncio.ensure_future(self.work.claim(limit, self.batch_id, self.line_range))
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            # The cancel must go on whatever the claim did: swallowing it here (a failed claim's error in its
            # place) would leave the loop running and ``stop`` waiting on it for ever.
            try:
                claimed = await pending
                await asyncio.gather(*(self.work.release(c) for c in claimed))
            except Exception as err:  # not handed back: their leases expire and the lines run again
                log.error("batch runner: claim not handed back on stop: %s", describe(err))
            raise

    async def _run(self, claim: ClaimedLine) -> None:
        try:
            started = time.monotonic()
            await self.work.run_line(claim)
            self.lines_run += 1
            log.debug("batch line %s ran in %.2f s", claim.request_id, time.monotonic() - started)
            final = await self.work.finalize(claim.batch_id)
            if final is not None:
                log.info("batch %s %s", claim.batch_id, final)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # its lease expires and the line runs again
            log.error("batch line %s not recorded: %s", claim.request_id, describe(err))
        finally:
            self._wake.set()
