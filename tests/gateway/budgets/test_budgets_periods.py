"""UTC period windows: keys, bounds, rollover, and round-tripping a key back to its window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from gateway.budgets.periods import PERIOD_NAMES, window_for, window_from_key


def test_day_week_month_windows() -> None:
    ts = datetime(2026, 11, 30, 23, 59, 59, tzinfo=UTC)  # a Monday
    day = window_for("day", ts)
    assert day.key == "day:2026-11-30"
    assert day.end == datetime(2026, 12, 1, tzinfo=UTC)
    week = window_for("week", ts)
    assert week.key == "week:2026-W49" and week.start == datetime(2026, 11, 30, tzinfo=UTC)
    month = window_for("month", ts)
    assert (month.key, month.start, month.end) == ("month:2026-11", datetime(2026, 11, 1, tzinfo=UTC),
                                                   datetime(2026, 12, 1, tzinfo=UTC))
    assert window_for("total", ts).key == "total" and window_for("total", ts).end is None


@pytest.mark.parametrize("period", ["day", "week", "month"])
def test_rollover_at_utc_boundary(period: str) -> None:
    end = window_for(period, datetime(2026, 12, 31, 12, tzinfo=UTC)).end  # type: ignore[arg-type]
    assert end is not None
    before = window_for(period, end - timedelta(microseconds=1))  # type: ignore[arg-type]
    after = window_for(period, end)  # type: ignore[arg-type]
    assert before.key != after.key and after.start == end


def test_non_utc_timestamps_are_converted() -> None:
    # 01:00 on Dec 1 in UTC+2 is still Nov 30 in UTC.
    ts = datetime(2026, 12, 1, 1, 0, tzinfo=timezone(timedelta(hours=2)))
    assert window_for("day", ts).key == "day:2026-11-30"
    assert window_for("month", ts).key == "month:2026-11"


def test_december_and_iso_week_year_edges() -> None:
    assert window_for("month", datetime(2026, 12, 5, tzinfo=UTC)).end == datetime(2027, 1, 1, tzinfo=UTC)
    w = window_for("week", datetime(2027, 1, 1, tzinfo=UTC))  # Friday of ISO week 2026-W53
    assert w.key == "week:2026-W53"


@pytest.mark.parametrize("period", PERIOD_NAMES)
def test_key_round_trip(period: str) -> None:
    w = window_for(period, datetime(2026, 3, 15, 8, tzinfo=UTC))  # type: ignore[arg-type]
    assert window_from_key(w.key) == w
