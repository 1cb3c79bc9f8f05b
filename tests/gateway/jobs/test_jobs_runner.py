"""``BatchRunner.stop`` under a claim that is in flight when the runner is stopped: the claim's outcome (lines
to hand back, or a database error) never swallows the stop."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.jobs.runner import BatchRunner


class _Work:
    """A stand-in for ``BatchWork`` whose claim waits for the test, then fails or returns lines."""

    def __init__(self, outcome: Exception | list[Any]) -> None:
        self.outcome = outcome
        self.claiming = asyncio.Event()
        self.release_claim = asyncio.Event()
        self.released: list[Any] = []

    async def claim(self, limit: int, batch_id: str | None = None) -> list[Any]:
        self.claiming.set()
        await self.release_claim.wait()
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    async def release(self, claim: Any) -> None:
        self.released.append(claim)

    async def sweep(self) -> list[str]:
        return []


async def _stop_during_claim(work: _Work) -> None:
    runner = BatchRunner(work, concurrency=2, poll_interval_s=0.05)  # type: ignore[arg-type]
    runner.start()
    await asyncio.wait_for(work.claiming.wait(), 5)
    stopping = asyncio.create_task(runner.stop())
    await asyncio.sleep(0)  # let stop() deliver the cancel while the claim is still running
    work.release_claim.set()
    done, _ = await asyncio.wait({stopping}, timeout=10)
    assert stopping in done, "stop() never returned: the runner loop swallowed its cancel and ran on"
    stopping.result()
    assert runner._task is not None and runner._task.cancelled()


async def test_stop_ends_even_when_the_claim_in_flight_fails() -> None:
    await _stop_during_claim(_Work(RuntimeError("unable to open database file")))


async def test_stop_hands_back_lines_claimed_while_stopping() -> None:
    work = _Work(["line-1", "line-2"])
    await _stop_during_claim(work)
    assert work.released == ["line-1", "line-2"]
