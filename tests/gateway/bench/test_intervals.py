"""gateway.bench.intervals: the interval of a median from its rounds' order statistics, and the
verdict it gives a target (the ledger bench's p99 ratio, obs-paired's cost)."""

from __future__ import annotations

import pytest

from gateway.bench.intervals import interval_verdict, median_interval


def test_median_interval_takes_the_order_statistics_that_cover_95_percent() -> None:
    # n = 12: the 3rd smallest and the 3rd largest, 1 - 2 * (1 + 12 + 66) / 4096 = 96.1% (the 4th
    # would cover only 85.4%)
    values = [1.072, 1.122, 1.089, 1.415, 1.484, 1.129, 0.958, 1.107, 1.284, 1.231, 1.030, 1.128]
    low, high, coverage = median_interval(values)
    assert (low, high) == (1.072, 1.284) and abs(coverage - (1 - 158 / 4096)) < 1e-12
    # n = 24 (two such runs): the 7th from each end, 97.7% (the 8th: 93.6%)
    low, high, coverage = median_interval(values + [v - 0.05 for v in values])
    assert (low, high) == (pytest.approx(1.057), pytest.approx(1.231)) and abs(coverage - 0.97734) < 1e-5
    # too few values for 95%: the extremes, with what they do cover
    assert median_interval([1.2, 1.0]) == (1.0, 1.2, 0.5)
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0, 1 - 2 / 32)
    with pytest.raises(ValueError):
        median_interval([])


def test_interval_verdict_settles_the_target_only_with_the_whole_interval() -> None:
    assert interval_verdict(1.01, 1.09, 0.96, 1.10) == "met"
    assert interval_verdict(1.11, 1.30, 0.96, 1.10) == "NOT met"
    assert interval_verdict(1.07, 1.28, 0.96, 1.10).startswith("not settled by these rounds: 1.10 lies inside")
    assert interval_verdict(1.01, 1.05, 0.5, 1.10) == "too few rounds for a 95% interval: not settled"
    assert interval_verdict(0.04, 0.07, 0.96, 0.05, shown="5%").endswith(": 5% lies inside the interval")
