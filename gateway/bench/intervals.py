"""Intervals for the benches' medians: how precisely a run's rounds pin a ratio, and whether they
settle a target (`tiergate bench ledger`'s p99 ratio, `tiergate bench obs-paired`'s cost).

Bench-only; imports nothing of the gateway.
"""

from __future__ import annotations

from math import comb


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of the population ``values`` are
    drawn from: the k-th smallest and the k-th largest value, k the largest rank whose two tails
    together leave at least ``confidence`` (the number of values below the median is
    Binomial(n, 1/2)). Returns (low, high, its exact coverage); with too few values for
    ``confidence`` (n < 6 at 95%): the smallest and the largest, and their lower coverage."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("no values")
    k, covered = 1, 1 - 2 * 0.5 ** n
    for rank in range(2, n // 2 + 1):
        coverage = 1 - 2 * sum(comb(n, i) for i in range(rank)) / 2 ** n
        if coverage < confidence:
            break
        k, covered = rank, coverage
    return ordered[k - 1], ordered[n - k], covered


def interval_verdict(low: float, high: float, coverage: float, target: float, confidence: float = 0.95, *,
                     shown: str | None = None) -> str:
    """Whether an interval of a ratio settles ``ratio <= target``: met (all of it at or below),
    NOT met (all of it above), or not settled by these rounds (the target inside it, or too few
    rounds for ``confidence``). ``shown``: the target as the report writes it (default ``0.00``)."""
    if coverage < confidence:
        return f"too few rounds for a {confidence:.0%} interval: not settled"
    if high <= target:
        return "met"
    if low > target:
        return "NOT met"
    return f"not settled by these rounds: {shown or f'{target:.2f}'} lies inside the interval"
