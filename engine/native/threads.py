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

CLEARLY = 3.0  # an arm this many times slower than the other after a step each is not explored further
PROBE_GAP_MAX = 16  # a probe that confirms the choice puts the next one twice as far off, up to this many gaps


class ThreadChoice:
    """Times steps on one thread and on ``threads`` (see the module docstring) and picks the faster.

    Exploring and probing cost what the slower arm costs, which on a loaded machine can be 100x (a team step of
    the demo model measured 96 ms against 0.3 ms on one thread, each barrier waiting out a time slice): so an
    arm clearly slower after one step is not explored further; a new batch size starts from the nearest
    decided smaller one's times (scaled by the batch size); and each batch size probes its other arm after
    ``probe_every`` of its own steps, then twice as far off each time the probe is slower than the arm chosen
    (up to ``PROBE_GAP_MAX`` times), and soon again when it was faster."""

    def __init__(self, probe_every: int = 64, window: int = 5, first: int = 4) -> None:
        self.probe_every = probe_every
        self.window = window  # the latest step times kept per arm (their median is its time)
        self.first = first  # steps timed on each before choosing: the two alternate until then
        self._arms: dict[tuple[int, int], _Arms] = {}  # by (batch, threads)

    def _new_arms(self, batch: int, threads: int) -> _Arms:
        arms = _Arms()
        seeds = [b for (b, t), a in self._arms.items() if t == threads and 2 <= b < batch and a.decided]
        if batch >= 2 and seeds:
            near = self._arms[max(seeds), threads]
            for arm in (0, 1):
                arms.recent[arm].append(near.seconds[arm] * batch / max(seeds))
                arms.seconds[arm] = arms.recent[arm][0]
            self._decide(arms)
        return arms

    def _decide(self, arms: _Arms) -> None:
        arms.decided, arms.gap = True, self.probe_every
        arms.next_probe = arms.uses + arms.gap

    def pick(self, batch: int, threads: int) -> int:
        """The thread count for the next step of ``batch`` sequences when ``threads`` are available."""
        if threads <= 1:
            return 1
        arms = self._arms.get((batch, threads))
        if arms is None:
            arms = self._arms[batch, threads] = self._new_arms(batch, threads)
        arms.uses += 1
        if not arms.decided:
            one, team = arms.seconds
            clear = min(arms.count) > 0 and max(one, team) > CLEARLY * min(one, team)
            if min(arms.count) < self.first and not clear:
                return threads if arms.count[1] <= arms.count[0] else 1
            self._decide(arms)
        faster_team = arms.seconds[1] <= arms.seconds[0]
        if arms.uses >= arms.next_probe:  # time the other one again
            arms.probing = True
            faster_team = not faster_team
        return threads if faster_team else 1

    def record(self, batch: int, threads: int, used: int, seconds: float) -> None:
        """A step of ``batch`` sequences took ``seconds`` on ``used`` of the ``threads`` available."""
        arms = self._arms.get((batch, threads))
        if arms is None:
            return
        arm = 1 if used > 1 else 0
        if arms.probing:
            arms.probing = False
            chosen = arms.seconds[1 - arm]
            arms.gap = min(2 * arms.gap, PROBE_GAP_MAX * self.probe_every) if seconds > chosen else \
                max(1, self.probe_every // 8)
            arms.next_probe = arms.uses + arms.gap
        arms.count[arm] += 1
        recent = arms.recent[arm]
        recent.append(seconds)
        if len(recent) > self.window:
            del recent[0]
        arms.seconds[arm] = sorted(recent)[len(recent) // 2]

    def faster(self, batch: int, threads: int) -> int | None:
        """The thread count chosen so far for ``batch`` sequences (None: not measured yet)."""
        arms = self._arms.get((batch, threads))
        if arms is None or not arms.decided:
            return None
        return threads if arms.seconds[1] <= arms.seconds[0] else 1


class _Arms:
    __slots__ = ("count", "decided", "gap", "next_probe", "probing", "recent", "seconds", "uses")

    def __init__(self) -> None:
        self.count = [0, 0]  # steps timed on one thread, on the team
        self.recent: tuple[list[float], list[float]] = ([], [])  # their latest step times
        self.seconds = [0.0, 0.0]  # the median of those
        self.uses = 0  # steps of this batch size
        self.decided = False  # explored: the faster arm runs, the other is probed
        self.gap = 0  # steps between probes
        self.next_probe = 0  # the step count at which the next probe runs
        self.probing = False  # the step picked last is a probe
