"""gateway.web.gc_pacing: a server's garbage collections on a clock, opt-in. Cycles are still freed
(within the interval), a burst of live objects no longer sets off a collection, the thresholds come
back at shutdown, and unset or ``TIERGATE_GC_INTERVAL_S=0`` keeps CPython's count-driven collector."""

from __future__ import annotations

import asyncio
import gc
import weakref
from contextlib import AsyncExitStack

import pytest

from gateway.web.gc_pacing import (
    BACKSTOP_GEN0,
    DEFAULT_INTERVAL_S,
    FULL_EVERY,
    GEN0_THRESHOLD,
    MIDDLE_EVERY,
    Pacer,
    generation_for,
    interval_from_env,
    pace_collections,
)


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_each_tick_collects_the_young_generation_and_older_ones_less_often() -> None:
    gens = [generation_for(t) for t in range(1, FULL_EVERY + 1)]
    assert gens.count(2) == 1 and gens[-1] == 2
    assert gens.count(1) == FULL_EVERY // MIDDLE_EVERY - 1
    assert gens[:MIDDLE_EVERY - 1] == [0] * (MIDDLE_EVERY - 1) and gens[MIDDLE_EVERY - 1] == 1


def test_the_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERGATE_GC_INTERVAL_S", raising=False)
    assert interval_from_env() == DEFAULT_INTERVAL_S == 0  # opt-in
    monkeypatch.setenv("TIERGATE_GC_INTERVAL_S", "0.25")
    assert interval_from_env() == 0.25
    monkeypatch.setenv("TIERGATE_GC_INTERVAL_S", "0")
    assert interval_from_env() == 0
    monkeypatch.setenv("TIERGATE_GC_INTERVAL_S", "-1")
    with pytest.raises(ValueError, match="TIERGATE_GC_INTERVAL_S"):
        interval_from_env()


def test_a_tick_counts_and_times_its_collection() -> None:
    pacer = Pacer(1.0)
    node = _Node()
    gone = weakref.ref(node)
    del node
    assert [pacer.tick() for _ in range(MIDDLE_EVERY)][-1] == 1
    assert gone() is None
    assert pacer.collections == [MIDDLE_EVERY - 1, 1, 0] and pacer.longest_pause_s > 0


async def test_paced_collections_free_cycles_and_a_burst_sets_none_off() -> None:
    thresholds = gc.get_threshold()
    async with AsyncExitStack() as stack:
        pacer = await pace_collections(stack, 0.05)
        assert pacer is not None
        assert gc.get_threshold() == (BACKSTOP_GEN0, *thresholds[1:])
        before = gc.get_stats()[0]["collections"]
        burst = [[i] for i in range(BACKSTOP_GEN0 // 4)]  # far past the old threshold0, all alive
        assert gc.get_stats()[0]["collections"] == before  # no collection walked them meanwhile
        del burst
        node = _Node()
        gone = weakref.ref(node)
        del node
        for _ in range(100):
            await asyncio.sleep(0.01)
            if gone() is None:
                break
        assert gone() is None and pacer.ticks >= 1  # freed by the clock's collection
        task = next(t for t in asyncio.all_tasks() if t.get_name() == "tiergate-gc-pacer")
    assert task.done()  # stopped with the stack
    assert gc.get_threshold() == thresholds


async def test_an_interval_of_zero_keeps_the_count_driven_collector() -> None:
    thresholds = gc.get_threshold()
    async with AsyncExitStack() as stack:
        assert await pace_collections(stack, 0) is None
        assert gc.get_threshold() == (GEN0_THRESHOLD, *thresholds[1:])
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "tiergate-gc-pacer"]
    assert gc.get_threshold() == thresholds
