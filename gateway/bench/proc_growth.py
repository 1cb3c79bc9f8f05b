"""A process's resident memory and open file descriptors, read from /proc, and their growth over
a long run as a trend (`tiergate bench soak`).

Growth is the median of the last quarter of the readings taken after warm-up (the first 20% of
the run) against the median of the first quarter, not the last reading against the first: the
fd count moves ±20% with the sockets in flight at the instant it is read, which two points turn
into a "leak"; a steady leak moves the medians. The point-to-point figure and the range are kept
beside it.

Bench-only.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path


def proc_stats(pid: int) -> tuple[int, int]:
    """``pid``'s resident set (KiB) and its open file descriptors."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Reading:
    """RSS and open fds, read once a second."""

    t_s: float
    rss_kib: int
    fds: int


@dataclass
class Growth:
    """Growth of one resource after warm-up, in percent."""

    trend: float  # median of the last quarter of readings vs median of the first quarter
    endpoints: float  # the last reading vs the first (noisy: what is in flight at two instants)
    low: int
    high: int
    readings: int  # how many readings after warm-up


def growth(readings: list[Reading], attr: str, minutes: float) -> Growth:
    """Growth of ``attr`` over the readings taken after warm-up (the first 20% of the run)."""
    warm = [r for r in readings if r.t_s >= 0.2 * minutes * 60] or readings
    values = [getattr(r, attr) for r in warm]
    if not values:
        return Growth(0.0, 0.0, 0, 0, 0)
    q = max(len(values) // 4, 1)
    first, last = statistics.median(values[:q]), statistics.median(values[-q:])

    def pct(a: float, b: float) -> float:
        return (b - a) / a * 100 if a else 0.0

    return Growth(pct(first, last), pct(values[0], values[-1]), min(values), max(values), len(values))
