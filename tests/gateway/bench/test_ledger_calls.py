"""gateway.bench.ledger_calls: each of the ledger's event-loop calls timed, the calls themselves
unchanged (results, suspensions, errors and cancellation pass through)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.bench.ledger_calls import TimedLedger


class FakeLedger:
    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.release: asyncio.Future[None] | None = None
        self.other = "passed through"

    async def begin(self, intent: Any) -> None:
        self.seen.append(("begin", intent))
        if intent == "fail":
            raise RuntimeError("journal full")

    async def wait_durable(self, level: str = "fsync") -> None:
        self.seen.append(("wait", level))
        if level == "suspend":  # waits for a future, as a waiter left to the journal thread does
            self.release = asyncio.get_running_loop().create_future()
            await self.release
            self.seen.append(("resumed", level))

    def record(self, entry: Any) -> None:
        sum(range(20_000))  # some CPU to time
        self.seen.append(("record", entry))

    def record_request(self, rec: Any) -> None:
        self.seen.append(("request", rec))


def test_calls_are_timed_and_passed_through() -> None:
    fake = FakeLedger()
    timed = TimedLedger(fake)

    async def run() -> None:
        await timed.begin("i1")
        timed.record("e1")
        timed.record_request("r1")
        await timed.wait_durable("process")

    asyncio.run(run())
    assert fake.seen == [("begin", "i1"), ("record", "e1"), ("request", "r1"), ("wait", "process")]
    assert {k: len(v) for k, v in timed.ns.items()} == {"begin": 1, "record": 1, "record_request": 1,
                                                        "wait_durable": 1}
    assert timed.ns["record"][0] > 0 and timed.per_request_us(1) > 0
    assert timed.other == "passed through"
    lines = timed.lines(1, 1000.0)
    assert "record x1.00" in lines[0] and "of the loop thread's 1000 us" in lines[1]


def test_a_call_that_suspends_finishes_as_if_awaited() -> None:
    fake = FakeLedger()
    timed = TimedLedger(fake)

    async def run() -> None:
        waiter = asyncio.ensure_future(timed.wait_durable("suspend"))
        await asyncio.sleep(0)
        assert not waiter.done() and fake.release is not None
        fake.release.set_result(None)
        await waiter

    asyncio.run(run())
    assert fake.seen == [("wait", "suspend"), ("resumed", "suspend")]
    assert len(timed.ns["wait_durable"]) == 1  # timed up to its suspension, once


def test_errors_and_cancellation_reach_the_caller() -> None:
    fake = FakeLedger()
    timed = TimedLedger(fake)

    async def run() -> None:
        with pytest.raises(RuntimeError, match="journal full"):
            await timed.begin("fail")
        waiter = asyncio.ensure_future(timed.wait_durable("suspend"))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert fake.release is not None and fake.release.cancelled()  # the cancellation reached the inner await

    asyncio.run(run())
    assert len(timed.ns["begin"]) == 1
