"""UTC budget periods (day, ISO week, month, total) derived from a timestamp.

A budget "resets" without any cron job: every counter is keyed by the period key of
the moment it is used, so the first request after a UTC boundary simply lands in a
new, empty window. Pure functions over ``datetime``; imports nothing from the gateway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Literal

PeriodName = Literal["day", "week", "month", "total"]
PERIOD_NAMES: tuple[PeriodName, ...] = ("day", "week", "month", "total")
Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class PeriodWindow:
    """One concrete window: ``[start, end)`` in UTC; ``end`` is None for ``total``."""

    period: PeriodName
    key: str
    start: datetime | None
    end: datetime | None

    @property
    def first_day(self) -> date | None:
        return self.start.date() if self.start else None

    @property
    def end_day(self) -> date | None:
        """Exclusive end date (daily_spend rows with day < end_day belong here)."""
        return self.end.date() if self.end else None

    def seconds_left(self, now: datetime) -> float | None:
        return None if self.end is None else max((self.end - _as_utc(now)).total_seconds(), 0.0)


def _as_utc(ts: datetime) -> datetime:
    if ts.tzinfo is None:
        return ts.replace(tzinfo=UTC)
    return ts.astimezone(UTC)


def window_for(period: PeriodName, ts: datetime) -> PeriodWindow:
    """The window of ``period`` that contains ``ts`` (naive timestamps are taken as UTC)."""
    ts = _as_utc(ts)
    midnight = ts.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return PeriodWindow("day", f"day:{midnight:%Y-%m-%d}", midnight, midnight + timedelta(days=1))
    if period == "week":
        start = midnight - timedelta(days=midnight.weekday())  # ISO weeks start on Monday
        iso = start.isocalendar()
        return PeriodWindow("week", f"week:{iso.year}-W{iso.week:02d}", start, start + timedelta(days=7))
    if period == "month":
        start = midnight.replace(day=1)
        end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
        return PeriodWindow("month", f"month:{start:%Y-%m}", start, end)
    if period == "total":
        return PeriodWindow("total", "total", None, None)
    raise ValueError(f"unknown budget period {period!r}")


def window_from_key(key: str) -> PeriodWindow:
    """Inverse of ``PeriodWindow.key`` (used by the reconciler to re-read a counter's window)."""
    if key == "total":
        return window_for("total", utc_now())
    period, _, value = key.partition(":")
    if period == "day":
        return window_for("day", datetime.strptime(value, "%Y-%m-%d").replace(tzinfo=UTC))
    if period == "week":
        year, week = value.split("-W")
        return window_for("week", datetime.fromisocalendar(int(year), int(week), 1).replace(tzinfo=UTC))
    if period == "month":
        return window_for("month", datetime.strptime(value + "-01", "%Y-%m-%d").replace(tzinfo=UTC))
    raise ValueError(f"not a period key: {key!r}")
