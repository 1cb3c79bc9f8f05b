"""Stall detection for the serving benches: when did in-flight requests stop completing, and was
the event loop blocked meanwhile?

``longest_stall`` reads a phase's request spans (start, end): its longest interval during which
at least one request was in flight and none completed. A p99 set by one such window (every
in-flight request waits through it) is a different finding from a tail spread over the phase,
so the bench prints both the p99 and the p99 of the requests that did not overlap the window.
``LoopLag`` samples the event loop while a phase runs: a task that sleeps ``interval_s`` and
records how late it woke. A stall with as much loop lag is the loop not running callbacks; a
stall without it is requests awaiting something slow (a lock, a thread, I/O). Where Linux
schedstat is there, each sample also says how the loop thread spent the time: on a CPU (this
process's own work on the loop), runnable but waiting for a CPU (other processes had the
cores: a machine too busy to measure on), or neither (the GIL held by another thread).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stall:
    """An interval with requests in flight and none completing; times in seconds from ``origin``."""

    start_s: float
    duration_s: float
    in_flight: int  # requests in flight when it ended (those that waited through its end)


def longest_stall(spans: Sequence[tuple[float, float]], origin: float = 0.0) -> Stall | None:
    """The longest interval during which some request of ``spans`` (start, end) was in flight and
    none completed; None without requests.

    Between two consecutive completions a and b (a: -inf before the first), every request in
    flight ends at b or later, so the interval with one in flight is [max(a, s), b] where s is
    the earliest start among the requests that end at or after b."""
    if not spans:
        return None
    ordered = sorted(spans, key=lambda se: se[1])
    suffix_start = [0.0] * len(ordered)  # earliest start among ordered[i:]
    earliest = float("inf")
    for i in range(len(ordered) - 1, -1, -1):
        earliest = min(earliest, ordered[i][0])
        suffix_start[i] = earliest
    best: tuple[float, float, int] | None = None  # (duration, start, index of the completion ending it)
    previous_end = float("-inf")
    for i, (_, end) in enumerate(ordered):
        begin = max(previous_end, suffix_start[i])
        if end > begin and (best is None or end - begin > best[0]):
            best = (end - begin, begin, i)
        previous_end = end
    if best is None:  # every request ended at the same instant it began
        return Stall(ordered[0][0] - origin, 0.0, 0)
    duration, begin, i = best
    end = ordered[i][1]
    in_flight = sum(1 for s, e in spans if s < end <= e)
    return Stall(begin - origin, duration, in_flight)


def overlapping(spans: Sequence[tuple[float, float]], stall: Stall, origin: float = 0.0) -> list[bool]:
    """For each span: whether it was in flight during part of ``stall``'s window."""
    lo = origin + stall.start_s
    hi = lo + stall.duration_s
    return [s < hi and e > lo for s, e in spans]


def thread_sched() -> tuple[float, float] | None:
    """The calling thread's (seconds on a CPU, seconds runnable but waiting for one) so far, from
    Linux's /proc/thread-self/schedstat; None where that file is missing."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, waiting = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(waiting) / 1e9


@dataclass(frozen=True)
class Lag:
    """One late wake-up of the sampler: when it was due (seconds from origin), how late it woke,
    and how the loop thread spent the sleep: on a CPU (running callbacks: this process's own
    work), runnable but waiting for a CPU (other processes had the cores), and the rest (blocked:
    the GIL held by another thread, a page fault; or idle). Seconds; the last two are 0 without
    schedstat."""

    at_s: float
    lag_s: float
    on_cpu_s: float = 0.0
    run_queue_s: float = 0.0


class LoopLag:
    """Samples how late the running event loop wakes a task that sleeps ``interval_s``
    (``samples``), and the loop thread's CPU and run-queue time meanwhile (``totals``)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.samples: list[Lag] = []
        self.origin = 0.0
        self._task: asyncio.Task[None] | None = None
        self._first: tuple[float, float] | None = None
        self._last: tuple[float, float] | None = None

    async def _run(self) -> None:
        sched = self._first = thread_sched()
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            due = before + self.interval_s
            lag = max(0.0, time.perf_counter() - due)
            now = thread_sched()
            if now is not None and sched is not None:
                self.samples.append(Lag(due - self.origin, lag, now[0] - sched[0], now[1] - sched[1]))
            else:
                self.samples.append(Lag(due - self.origin, lag))
            sched = self._last = now

    def start(self, origin: float) -> None:
        self.origin = origin
        self._task = asyncio.get_running_loop().create_task(self._run(), name="bench-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def worst(self) -> Lag:
        """The latest wake-up (a zero one without samples)."""
        return max(self.samples, key=lambda s: s.lag_s, default=Lag(0.0, 0.0))

    def totals(self) -> tuple[float, float]:
        """The loop thread's (seconds on a CPU, seconds waiting for one) while sampled; zeros
        without schedstat."""
        if self._first is None or self._last is None:
            return 0.0, 0.0
        return self._last[0] - self._first[0], self._last[1] - self._first[1]
