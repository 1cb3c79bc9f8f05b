"""What the ledger's calls cost the event loop, call by call (`tiergate bench ledger`).

``TimedLedger`` wraps a ``Ledger`` and times, in the loop thread's CPU time, each call a request
makes into it on the event loop (``begin`` for a call's intent, ``record``, ``record_request``,
``wait_durable``), up to the point where the call returns or first suspends (under the default
``process`` durability none of them suspends: the loop writes the journal itself). Everything else
is passed through. The timer itself (``thread_time_ns``, a system call on most VMs) adds ~1 us a
call, so the bench runs it in a phase of its own, never in the phases whose p99s it compares.

Bench-only (gateway.bench).
"""

from __future__ import annotations

import statistics
import time
import types
from collections.abc import Coroutine, Generator
from typing import Any

CALLS = ("begin", "record", "record_request", "wait_durable")


@types.coroutine
def _rest(coro: Coroutine[Any, Any, Any], pending: Any) -> Generator[Any, Any, Any]:
    """Finish ``coro`` (suspended on ``pending``) as if it were awaited from the start."""
    while True:
        try:
            sent = yield pending
        except BaseException as exc:  # (cancellation) into the coroutine
            try:
                pending = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                pending = coro.send(sent)
            except StopIteration as stop:
                return stop.value


class TimedLedger:
    def __init__(self, ledger: Any) -> None:
        self._ledger = ledger
        self.ns: dict[str, list[int]] = {name: [] for name in CALLS}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)

    async def _timed(self, name: str, coro: Coroutine[Any, Any, Any]) -> Any:
        t0 = time.thread_time_ns()
        try:
            pending = coro.send(None)
        except StopIteration as stop:
            self.ns[name].append(time.thread_time_ns() - t0)
            return stop.value
        except BaseException:
            self.ns[name].append(time.thread_time_ns() - t0)
            raise
        self.ns[name].append(time.thread_time_ns() - t0)
        return await _rest(coro, pending)

    async def begin(self, intent: Any) -> None:
        await self._timed("begin", self._ledger.begin(intent))

    async def wait_durable(self, level: Any = "fsync") -> None:
        await self._timed("wait_durable", self._ledger.wait_durable(level))

    def record(self, entry: Any) -> None:
        t0 = time.thread_time_ns()
        try:
            self._ledger.record(entry)
        finally:
            self.ns["record"].append(time.thread_time_ns() - t0)

    def record_request(self, rec: Any) -> None:
        t0 = time.thread_time_ns()
        try:
            self._ledger.record_request(rec)
        finally:
            self.ns["record_request"].append(time.thread_time_ns() - t0)

    def per_request_us(self, requests: int) -> float:
        """The timed calls' CPU per request (all calls over ``requests``), µs."""
        return sum(sum(v) for v in self.ns.values()) / max(requests, 1) / 1000

    def lines(self, requests: int, loop_us: float) -> list[str]:
        """``requests``: those that went through this ledger (warm-up included); ``loop_us``: the loop
        thread's CPU per request of the phase."""
        calls = "; ".join(f"{name} x{len(v) / max(requests, 1):.2f} p50 {statistics.median(v) / 1000:.1f} us "
                          f"mean {statistics.fmean(v) / 1000:.1f} us" for name, v in self.ns.items() if v)
        mine = self.per_request_us(requests)
        share = f" ({mine / loop_us:.0%} of it)" if loop_us > 0 else ""
        return [f"  the ledger's calls on the event loop (thread CPU up to each call's return or first suspension; "
                f"the timer adds ~1 us a call): {calls}",
                f"  per request {mine:.0f} us of the loop thread's {loop_us:.0f} us{share}"]
