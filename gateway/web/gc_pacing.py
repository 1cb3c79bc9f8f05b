"""``pace_collections``: a server's garbage collections on a clock, not on allocation counts.

CPython starts a young-generation collection whenever container objects allocated minus those
freed pass ``threshold0`` since the last one, and every collection stops the event loop for every
request in flight. A chat request through tiergate leaves no reference cycles behind (reference
counting frees all of it: ``tests/gateway/bench/test_ledger_load.py``), so what such a collection
mostly does is walk the objects of the requests in flight, find them alive and promote them.
That makes the count-driven collector worst exactly when a server is busiest: a burst of arrivals
allocates faster than answers free (the count passes the threshold sooner), and each collection
walks more live objects (it lasts longer): the more requests are in flight, the more often it
runs and the longer each run, and every pause queues more of them. `tiergate bench ledger`'s open loop at 60% of
capacity on two cores (2026-12-04, AMD EPYC, before this module) ran 102 young collections in
its ledger-on phases, 636 ms in all, max 18.9 ms, and 5 of the middle generation, 168 ms, one of
67.6 ms; that stall's queue set the phase's p99 (up to 19x the ledger-off phase's in one round).

Paced, the automatic collector is only a backstop (``threshold0`` = ``BACKSTOP_GEN0``, for a
process that allocates cycles in a burst without yielding to its loop), and a task on the event
loop collects on a clock: the youngest generation every ``interval_s``, the middle one every
``MIDDLE_EVERY`` ticks, everything (the startup heap stays frozen, see gateway.app) every
``FULL_EVERY`` ticks. A pause then still walks what is in flight, but a burst no longer sets off
more of them. Cycles some paths do leave (an ``httpx`` response of a library's upstream call is
one; an exception kept with its traceback another) wait at most ``interval_s`` to be freed.

**Opt-in** (``TIERGATE_GC_INTERVAL_S``, e.g. ``1``; unset or ``0``: not paced, CPython's own
collector at ``GEN0_THRESHOLD``). Why not the default: `tiergate bench soak --minutes 20` from a clean
clone (2026-12-04, the AMD EPYC machine) paced at 1 s measured the mix's max at 248 requests/s (182
unpaced), soaked at 70% of that (174/s against 127) and fell behind after ~10 minutes (open fds
50 -> 190-480, /healthz p99 110-185 ms, RSS 266 -> 349 MiB; 0 failed, every call billed once), where
the unpaced soak held flat (RSS +0.9%, fds -3.8%). The two ran at different loads, so that is not a
verdict on pacing, but nothing here shows a long mixed load (streams, cut streams, pipelines,
batches) is safe with it yet. Imports the standard library only.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Callable
from contextlib import AsyncExitStack

DEFAULT_INTERVAL_S = 0.0  # not paced unless TIERGATE_GC_INTERVAL_S says so (e.g. 1: the youngest generation every 1 s)
MIDDLE_EVERY = 10  # ... the middle one every this many ticks
FULL_EVERY = 300  # ... and all of them every this many (5 minutes at 1 s)
BACKSTOP_GEN0 = 200_000  # the automatic collector's threshold0 while paced: only a backstop
GEN0_THRESHOLD = 10_000  # threshold0 when not paced (CPython's default: 700)


def interval_from_env(default: float = DEFAULT_INTERVAL_S) -> float:
    raw = os.environ.get("TIERGATE_GC_INTERVAL_S")
    if raw is None or raw.strip() == "":
        return default
    value = float(raw)
    if value < 0:
        raise ValueError(f"TIERGATE_GC_INTERVAL_S must be >= 0 (0: not paced), got {raw!r}")
    return value


def generation_for(tick: int) -> int:
    """The generation the ``tick``-th paced collection (1, 2, ...) collects."""
    if tick % FULL_EVERY == 0:
        return 2
    if tick % MIDDLE_EVERY == 0:
        return 1
    return 0


class Pacer:
    """The clock's collections, counted (``collections`` per generation) and timed
    (``longest_pause_s``)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.interval_s = interval_s
        self.ticks = 0
        self.collections = [0, 0, 0]
        self.longest_pause_s = 0.0
        self._clock = clock

    def tick(self) -> int:
        """One paced collection; returns its generation."""
        self.ticks += 1
        generation = generation_for(self.ticks)
        started = self._clock()
        gc.collect(generation)
        self.longest_pause_s = max(self.longest_pause_s, self._clock() - started)
        self.collections[generation] += 1
        return generation

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.tick()


async def pace_collections(stack: AsyncExitStack, interval_s: float | None = None) -> Pacer | None:
    """Collect on a clock on the running loop until ``stack`` closes (then the thresholds are put
    back). ``interval_s`` None: ``TIERGATE_GC_INTERVAL_S`` (unset: not paced); 0: not paced,
    CPython's collector at ``GEN0_THRESHOLD`` (returns None)."""
    interval = interval_from_env() if interval_s is None else interval_s
    old = gc.get_threshold()
    stack.callback(gc.set_threshold, *old)
    if interval <= 0:
        gc.set_threshold(GEN0_THRESHOLD, *old[1:])
        return None
    gc.set_threshold(BACKSTOP_GEN0, *old[1:])
    pacer = Pacer(interval)
    task = asyncio.get_running_loop().create_task(pacer.run(), name="tiergate-gc-pacer")

    async def stop() -> None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    stack.push_async_callback(stop)
    return pacer
