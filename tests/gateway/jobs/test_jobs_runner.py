"""``BatchRunner.stop`` under a claim that is in flight when the runner is stopped: the claim's outcome (lines
to hand back, or a database error) never swallows the stop. The heartbeat extends the leases of the
lines in flight (and only those) every third of a lease."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.jobs.runner import BatchRunner


class _Work:
    """A stand-in for ``BatchWork`` whose claim waits for the test, then fails or returns lines."""

    lease_s = 30.0

    def __init__(self, outcome: Exception | list[Any]) -> None:
        self.outcome = outcome
        self.claiming = asyncio.Event()
        self.release_claim = asyncio.Event()
        self.released: list[Any] = []

    async def claim(self, limit: int, batch_id: str | None = None, line_range: Any = None) -> list[Any]:
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


class _SlowLines:
    """A stand-in for ``BatchWork`` with one chunk of two lines: ``a`` runs for a while, ``b`` at once."""

    lease_s = 0.3

    def __init__(self) -> None:
        self.claimed = False
        self.beats: list[list[str]] = []
        self.finished: list[str] = []

    async def claim(self, limit: int, batch_id: str | None = None, line_range: Any = None) -> list[str]:
        if self.claimed:
            return []
        self.claimed = True
        return ["a", "b"]

    async def run_line(self, claim: str) -> None:
        await asyncio.sleep(0.5 if claim == "a" else 0)
        self.finished.append(claim)

    async def heartbeat(self, claims: list[str]) -> int:
        self.beats.append(sorted(claims))
        return len(claims)

    async def finalize(self, batch_id: str) -> None:
        return None

    async def has_unsettled(self, batch_id: str, line_range: Any = None) -> bool:
        return len(self.finished) < 2


async def test_the_heartbeat_extends_the_leases_of_the_lines_in_flight() -> None:
    work = _SlowLines()
    runner = BatchRunner(work, concurrency=4, poll_interval_s=0.01, batch_id="b", line_range=(1, 2))  # type: ignore[arg-type]
    await asyncio.wait_for(runner.run_until_settled(), 10)
    assert sorted(work.finished) == ["a", "b"] and runner.lines_run == 2
    assert work.beats and all(beat == ["a"] for beat in work.beats)  # b was done before the first beat


class _IdleWork(_Work):
    """Nothing to claim: the runner waits for its wake between polls."""

    def __init__(self) -> None:
        super().__init__([])
        self.polled = asyncio.Event()

    async def claim(self, limit: int, batch_id: str | None = None, line_range: Any = None) -> list[Any]:
        return []

    async def sweep(self) -> list[str]:
        self.polled.set()
        return []


async def test_stop_ends_when_the_wake_comes_with_the_cancel() -> None:
    """A line that finishes sets the runner's wake; a stop in the same loop iteration must still end the
    loop. (With ``asyncio.wait_for`` around the wake, Python 3.11 returned the wait's result and dropped
    the cancel: the loop ticked on and ``stop`` never returned — a CI hang.)"""
    work = _IdleWork()
    runner = BatchRunner(work, concurrency=2, poll_interval_s=30.0)  # type: ignore[arg-type]
    runner.start()
    await asyncio.wait_for(work.polled.wait(), 5)
    await asyncio.sleep(0.01)  # the loop is now waiting for its wake (up to the 30 s poll)
    runner.wake()  # the wait's own future completes first...
    assert runner._task is not None
    runner._task.cancel()  # ...and the cancel comes before the loop runs again
    done, _ = await asyncio.wait({runner._task}, timeout=5)
    assert runner._task in done and runner._task.cancelled(), "the runner swallowed its cancel and ran on"
    await runner.stop()
