"""What the ledger costs the event loop (`tiergate bench ledger`): the loop thread's CPU per
request with the ledger off and on (``loop_cpu_line``), and call by call (``timed_calls_phase``).

``TimedLedger`` wraps a ``Ledger`` and times, in the loop thread's CPU time, each call a request
makes into it on the event loop (``begin`` for a call's intent, ``record``, ``record_request``,
``wait_durable``), up to the point where the call returns or first suspends (under the default
``process`` durability none of them suspends: the loop writes the journal itself). Everything else
is passed through. The timer itself (``thread_time_ns``, a system call on most VMs) adds ~1 us a
call, so the bench runs it in a phase of its own, never in the phases whose p99s it compares.

Bench-only (gateway.bench).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import types
from collections.abc import Coroutine, Generator
from typing import Any

from gateway.bench.ledger_load import WARM_UP, FullCollections, Phase, serve_phase

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

    def _timed_call(self, name: str, arg: Any) -> None:
        t0 = time.thread_time_ns()
        try:
            getattr(self._ledger, name)(arg)
        finally:
            self.ns[name].append(time.thread_time_ns() - t0)

    def record(self, entry: Any) -> None:
        self._timed_call("record", entry)

    def record_request(self, rec: Any) -> None:
        self._timed_call("record_request", rec)

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


def timed_calls_phase(app_with: Any, ledger: Any, raw: str, n: int, concurrency: int, rate: float | None) -> list[str]:
    """One more ledger-on phase (at the first open-loop rate, else closed loop), not in any ratio:
    each of the ledger's calls on the event loop timed (gateway.bench.ledger_calls)."""
    timed = TimedLedger(ledger)
    phase = asyncio.run(serve_phase(app_with(timed), raw, n, concurrency, FullCollections(), "timed", 0, rate=rate,
                                    seed=0))
    assert ledger.flush(120), "ledger did not drain"
    shape = f"open loop at {rate:.0f}/s" if rate else "closed loop"
    return [f"where the ledger's loop-thread time goes: one more ledger-on phase ({n} requests, {shape}), not in "
            "the ratios above", *timed.lines(n + WARM_UP, phase.loop_sched[0] / n * 1e6)]


def loop_cpu_line(phases: list[Phase]) -> str:
    """The loop thread's CPU per request, ledger off vs on: the ledger's cost on the loop, which the
    p99s show only through queueing (median of the phases, and of each round's on/off ratio)."""
    def per_request_us(p: Phase) -> float:
        return p.loop_sched[0] / max(len(p.spans), 1) * 1e6

    def busy(p: Phase) -> float:  # the loop thread's share of the phase's time on a CPU
        wall_s = max((e for _, e in p.spans), default=p.origin) - p.origin
        return p.loop_sched[0] / wall_s if wall_s > 0 else 0.0

    off = [per_request_us(p) for p in phases if p.kind == "off"]
    on = [per_request_us(p) for p in phases if p.kind == "on"]
    ratios = [b / a for a, b in zip(off, on, strict=True) if a > 0]
    busy_off = statistics.median(busy(p) for p in phases if p.kind == "off")
    busy_on = statistics.median(busy(p) for p in phases if p.kind == "on")
    return (f"  loop thread CPU per request (median of the phases): ledger off {statistics.median(off):.0f} us, on "
            f"{statistics.median(on):.0f} us; on/off median of the rounds {statistics.median(ratios):.3f} "
            f"[{min(ratios):.3f}..{max(ratios):.3f}]; the loop thread on a CPU {busy_off:.0%} / {busy_on:.0%} of "
            "the phase (off / on: near 100% a request's wait is the queue in front of it)")
