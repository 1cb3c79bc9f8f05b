"""`ThreadChoice`: whether a one-call decode step runs on a thread team or on one thread, by its measured time.

A decode step of a small model runs as one thread team (tg_step.c) with about ten barriers per layer, and a
barrier waits for the slowest thread: where another process holds one of the cores, a thread of the team
loses it for scheduler time slices and the whole step waits. Measured here (the demo model, bf16, two
threads, a busy loop on the other core): ~980 tok/s on the team against ~1,840 on one thread, while on an idle
machine the team is ~1.45x faster than one thread. The kernels' results do not depend on the thread count, so
the choice is free to follow the measurements: each (batch size, thread count) keeps the median of the step's
last few times on one thread and on the team (a median: one step the scheduler delayed by a time slice, ten
times the usual, would hold a moving average up for many steps, and with it the wrong choice), the faster one
runs, and the other is timed again once every ``probe_every`` steps, so a change of load is noticed within a
few probes.

Pure Python; imports nothing outside the standard library.
"""

from __future__ import annotations


class ThreadChoice:
    """Times steps on one thread and on ``threads`` (see the module docstring) and picks the faster."""

    def __init__(self, probe_every: int = 64, window: int = 5, first: int = 4) -> None:
        self.probe_every = probe_every
        self.window = window  # the latest step times kept per arm (their median is its time)
        self.first = first  # steps timed on each before choosing: the two alternate until then
        self._arms: dict[tuple[int, int], _Arms] = {}  # by (batch, threads)
        self._steps = 0

    def pick(self, batch: int, threads: int) -> int:
        """The thread count for the next step of ``batch`` sequences when ``threads`` are available."""
        if threads <= 1:
            return 1
        arms = self._arms.get((batch, threads))
        if arms is None:
            arms = self._arms[batch, threads] = _Arms()
        self._steps += 1
        if min(arms.count) < self.first:
            return threads if arms.count[1] <= arms.count[0] else 1
        faster_team = arms.seconds[1] <= arms.seconds[0]
        if self._steps % self.probe_every == 0:  # time the other one again
            faster_team = not faster_team
        return threads if faster_team else 1

    def record(self, batch: int, threads: int, used: int, seconds: float) -> None:
        """A step of ``batch`` sequences took ``seconds`` on ``used`` of the ``threads`` available."""
        arms = self._arms.get((batch, threads))
        if arms is None:
            return
        arm = 1 if used > 1 else 0
        arms.count[arm] += 1
        recent = arms.recent[arm]
        recent.append(seconds)
        if len(recent) > self.window:
            del recent[0]
        arms.seconds[arm] = sorted(recent)[len(recent) // 2]

    def faster(self, batch: int, threads: int) -> int | None:
        """The thread count chosen so far for ``batch`` sequences (None: not measured yet)."""
        arms = self._arms.get((batch, threads))
        if arms is None or min(arms.count) < self.first:
            return None
        return threads if arms.seconds[1] <= arms.seconds[0] else 1


class _Arms:
    __slots__ = ("count", "recent", "seconds")

    def __init__(self) -> None:
        self.count = [0, 0]  # steps timed on one thread, on the team
        self.recent: tuple[list[float], list[float]] = ([], [])  # their latest step times
        self.seconds = [0.0, 0.0]  # the median of those
