"""Per-thread tallies of gateway.telemetry.metrics' samples, folded into prometheus_client's values.

The request path does not call prometheus_client per sample: each thread adds to plain cells of its
own (``_Tallies``: a running total per labelled child — for a histogram one per bucket and the sum —
that only that thread writes), and ``fold`` adds what each cell gained since the last fold to
prometheus_client's values (a lock and a method call per child per fold, not per sample). Folds run
before every exposition, every ``FOLD_INTERVAL_S`` in a daemon thread (``_Folder``) and at exit.

Imports nothing of prometheus_client's beyond the metric objects it is handed.
"""

from __future__ import annotations

import atexit
import os
import threading
from bisect import bisect_left
from typing import Any

FOLD_INTERVAL_S = 1.0


# -- tallies: per-thread running totals, folded into prometheus_client's values ------------------
class _Tallies(threading.local):
    """This thread's cells: (metric, *labels) -> [totals, folded]. ``totals`` is written by this
    thread only (a counter: [n]; a histogram: one count per bucket, then the sum); ``folded`` by
    ``fold`` only (under its lock): what of ``totals`` is already in prometheus_client's values."""

    def __init__(self) -> None:
        self.cells: dict[Any, tuple[list[float], list[float]]] = {}
        # The request path's shortcuts to this thread's totals, by the event's own labels (one
        # lookup an event instead of one per series; the cells themselves are the ones above)
        self.http: dict[tuple[str, str, str, int], tuple[list[float], list[float], tuple[float, ...]]] = {}
        self.attempts: dict[tuple[str, str], tuple[list[float], list[float], tuple[float, ...]]] = {}
        self.entries: dict[tuple[str, str, str, str], tuple[list[float], list[float], list[float], list[float]]] = {}
        self.requests: dict[tuple[str, str], list[float]] = {}
        with _fold_lock:
            _all_cells.append(self.cells)


_fold_lock = threading.Lock()
_all_cells: list[dict[Any, tuple[list[float], list[float]]]] = []  # every thread's cells (kept after it ends)
_tallies = _Tallies()
_bounds: dict[tuple[Any, ...], tuple[float, ...]] = {}  # a histogram's key -> its upper bounds (+Inf last)


def _totals(key: tuple[Any, ...]) -> list[float]:
    """This thread's running totals for counter ``key`` = (metric, *labels)."""
    cell = _tallies.cells.get(key)
    if cell is None:
        cell = _tallies.cells[key] = ([0.0], [0.0])
    return cell[0]


def _histogram(key: tuple[Any, ...]) -> tuple[list[float], tuple[float, ...]]:
    """This thread's running totals for histogram ``key`` (one per bucket, then the sum) and the
    buckets' upper bounds (+Inf last)."""
    cell = _tallies.cells.get(key)
    if cell is None:
        _bounds[key] = tuple(_child(*key)._upper_bounds)
        cell = _tallies.cells[key] = ([0.0] * (len(_bounds[key]) + 1), [0.0] * (len(_bounds[key]) + 1))
    return cell[0], _bounds[key]


def _add(key: tuple[Any, ...], amount: float = 1.0) -> None:
    """``metric.labels(*labels).inc(amount)`` for ``key`` = (metric, *labels), tallied (the
    labelled child is looked up when folded, not per sample)."""
    cell = _tallies.cells.get(key)
    if cell is None:
        cell = _tallies.cells[key] = ([0.0], [0.0])
    cell[0][0] += amount


def _observe(key: tuple[Any, ...], value: float) -> None:
    """``metric.labels(*labels).observe(value)`` for ``key`` = (metric, *labels), tallied (bucket:
    the first upper bound >= value, as prometheus_client's ``observe`` picks it)."""
    cell = _tallies.cells.get(key)
    if cell is None:
        _bounds[key] = tuple(_child(*key)._upper_bounds)
        cell = _tallies.cells[key] = ([0.0] * (len(_bounds[key]) + 1), [0.0] * (len(_bounds[key]) + 1))
    totals = cell[0]
    totals[bisect_left(_bounds[key], value)] += 1
    totals[-1] += value


def _items(cells: dict[Any, tuple[list[float], list[float]]]) -> list[tuple[Any, tuple[list[float], list[float]]]]:
    """``list(cells.items())`` while the owning thread may add keys. That list is not one step:
    each item is a new tuple, whose allocation can start a garbage collection, whose finalizers
    run Python code, where the owner can take the GIL and add a key; the list then raises
    ``RuntimeError: dictionary changed size during iteration`` (seen in CI). Try again: the owner
    only adds, and adds rarely (a new label set)."""
    while True:
        try:
            return list(cells.items())
        except RuntimeError:
            continue


def fold() -> None:
    """Add what every thread's cells gained since the last fold to prometheus_client's values
    (a histogram's: its buckets and its sum, as its ``observe`` adds them)."""
    with _fold_lock:
        for cells in _all_cells:
            for key, (totals, folded) in _items(cells):
                if totals == folded:  # nothing new (a series that only ever got 0 is never created)
                    continue
                child = _child(*key)  # the labelled child, cached by the same key
                if len(totals) == 1:
                    now = totals[0]
                    child.inc(now - folded[0])
                    folded[0] = now
                    continue
                for i in range(len(totals) - 1):
                    now = totals[i]
                    if now != folded[i]:
                        child._buckets[i].inc(now - folded[i])
                        folded[i] = now
                now = totals[-1]
                if now != folded[-1]:
                    child._sum.inc(now - folded[-1])
                    folded[-1] = now


class _Folder:
    """The daemon thread that folds every ``FOLD_INTERVAL_S`` (one per process; restarted in a
    forked child, whose parent's thread did not come along), and the fold at exit."""

    thread: threading.Thread | None = None
    pid = 0

    @classmethod
    def ensure(cls) -> None:
        if cls.thread is not None and cls.pid == os.getpid() and cls.thread.is_alive():
            return
        cls.pid = os.getpid()
        cls.thread = threading.Thread(target=cls._run, name="tiergate-metrics-fold", daemon=True)
        cls.thread.start()

    @staticmethod
    def _run() -> None:
        stop = threading.Event()
        while not stop.wait(FOLD_INTERVAL_S):
            fold()


def _after_fork_in_child() -> None:
    """A forked child inherits its parent's cells: what they hold is the parent's to fold."""
    for cells in _all_cells:
        for totals, folded in cells.values():
            folded[:] = totals
    _Folder.thread = None


atexit.register(fold)
os.register_at_fork(after_in_child=_after_fork_in_child)


# -- cheap children: a plain dict in front of prometheus_client's locked label lookup -----------
_children: dict[tuple[Any, ...], Any] = {}


def _child(metric: Any, *labels: str) -> Any:
    key = (metric, *labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*labels)
    return child
