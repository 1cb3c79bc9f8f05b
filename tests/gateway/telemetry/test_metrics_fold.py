"""The metrics fold thread reads every thread's tally cells while their owners add to them: a
snapshot of a dict another thread adds to must not raise (CI saw ``RuntimeError: dictionary
changed size during iteration`` in the fold thread). A garbage collection inside the snapshot,
whose finalizers let another thread run, is what makes a plain ``list(d.items())`` fail."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

from gateway.telemetry.tallies import _items

Cells = dict[Any, tuple[list[float], list[float]]]


class _Cycle:
    """Cyclic garbage with a finalizer that lets another thread take the GIL."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        time.sleep(0)


def _race(snapshot: Callable[[Cells], object], seconds: float) -> int:
    """How many snapshots of a dict raised while another thread kept adding keys to it."""
    cells: Cells = {i: ([0.0], [0.0]) for i in range(2000)}
    stop = threading.Event()

    def owner() -> None:  # adds only, as a thread adds its new label sets
        k = 10**6
        while not stop.is_set():
            cells[k] = ([0.0], [0.0])
            k += 1
            time.sleep(0)

    thread = threading.Thread(target=owner)
    old = gc.get_threshold()
    gc.set_threshold(700)
    thread.start()
    errors, end = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            gc.collect(0)
            for _ in range(600):  # close to the threshold: the snapshot's own allocations start a collection
                _Cycle()
            try:
                snapshot(cells)
            except RuntimeError:
                errors += 1
    finally:
        gc.set_threshold(*old)
        stop.set()
        thread.join()
    return errors


def test_the_fold_snapshot_survives_an_owner_adding_during_a_collection() -> None:
    # The set-up does race: a plain list() of the items raises in it (within ten seconds).
    spent, start = 0.0, time.monotonic()
    while _race(lambda cells: list(cells.items()), 0.5) == 0:
        assert time.monotonic() - start < 10, "the set-up never raced"
    spent = time.monotonic() - start
    assert _race(_items, max(spent, 1.0)) == 0
