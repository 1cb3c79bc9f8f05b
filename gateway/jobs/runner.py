"""``BatchRunner``: an asyncio loop that keeps up to ``concurrency`` batch lines in flight.

It claims runnable lines (of every batch, or of one), runs each as a task, finalizes a batch
when its last line settles, and sleeps until woken (a batch was created) or ``poll_interval_s``
passes (a lease may have expired, another process may have added work). The embedded backend
runs one per gateway process for its lifetime (``start``/``stop``); a Celery task runs one for a
single batch until that batch is final (``run_until_final``). Errors in the loop are logged and
retried after the poll interval; they never kill it. Imports jobs.batch only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.jobs.batch import BatchWork
from gateway.jobs.store import ClaimedLine
from gateway.log_safety import describe

log = logging.getLogger("tiergate.jobs")


class BatchRunner:
    def __init__(self, work: BatchWork, *, concurrency: int, poll_interval_s: float,
                 batch_id: str | None = None) -> None:
        self.work, self.concurrency, self.poll_interval_s = work, concurrency, poll_interval_s
        self.batch_id = batch_id
        self._inflight: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="tiergate-batch-runner")

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        """Stop claiming; lines in flight are cancelled and handed back (billed for what they spent)."""
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
        try:
            while await self.work.is_open(self.batch_id):
                await self._tick()
        finally:
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
                    task.add_done_callback(self._inflight.discard)
            if not claimed and not self._inflight:
                await (self.work.finalize(self.batch_id) if self.batch_id else self.work.sweep())
        except Exception as err:  # the database may be briefly away: log, wait, try again
            log.error("batch runner: %s", describe(err))
        if not claimed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s)
            self._wake.clear()

    async def _claim(self, limit: int) -> list[ClaimedLine]:
        """Claim lines; if this runner is stopped meanwhile, the claimed lines are handed back."""
        pending = asyncio.ensure_future(self.work.claim(limit, self.batch_id))
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
            await self.work.run_line(claim)
            await self.work.finalize(claim.batch_id)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # its lease expires and the line runs again
            log.error("batch line %s not recorded: %s", claim.request_id, describe(err))
        finally:
            self._wake.set()
