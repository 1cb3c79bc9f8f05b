"""`tiergate bench soak`: the growth statistic (a trend over once-a-second readings, so the sockets
in flight at two instants do not read as a leak, while a steady leak does), and a short smoke run
against `tiergate serve` that ends with the money invariant holding. No timing is asserted."""

from __future__ import annotations

import random
import re
from decimal import Decimal

import pytest

from gateway.bench.ledger_match import match_rows
from gateway.bench.proc_growth import Reading, growth
from gateway.bench.soak import SoakArgs, run_soak


def _readings(values: list[int]) -> list[Reading]:
    return [Reading(float(i), 100_000, v) for i, v in enumerate(values)]


def test_growth_ignores_in_flight_noise_and_sees_a_steady_leak() -> None:
    rng = random.Random(3)
    flat = [rng.randint(45, 65) for _ in range(1200)]
    flat[240], flat[-1] = 45, 65  # the first reading after warm-up low, the last one high
    g = growth(_readings(flat), "fds", minutes=20)
    assert g.endpoints > 40  # what the old point-to-point figure would have reported
    assert abs(g.trend) < 5
    assert (g.low, g.high) == (45, 65)
    assert g.readings == 960  # the 240 readings of the first 20% (warm-up) left out

    leak = [50 + i // 40 + rng.randint(-5, 5) for i in range(1200)]  # one fd every 40 s
    assert growth(_readings(leak), "fds", minutes=20).trend > 20


def test_growth_uses_only_readings_after_warm_up() -> None:
    values = [10] * 240 + [100] * 960  # fds opened during the first 20% of a 20 min run, then flat
    assert growth(_readings(values), "fds", minutes=20).trend == 0.0
    assert growth([], "fds", minutes=20).trend == 0.0


def test_invariant_matches_rows_to_calls_by_id() -> None:
    rows = [("a", "ok", Decimal("0.1")), ("b", "ok", Decimal("0.2")), ("c", "cancelled", Decimal("0.01")),
            ("d", "interrupted", Decimal("0.3"))]
    check = match_rows({"a": 1, "b": 1}, rows)  # c and d never reached the upstream
    assert check.ok and (check.calls, check.rows, check.lost, check.repeated) == (2, 4, 0, 0)
    assert check.unsent == {"cancelled": (1, Decimal("0.01")), "interrupted": (1, Decimal("0.3"))}
    assert check.total == Decimal("0.61")
    assert "1 cancelled ($0.01), 1 interrupted ($0.3)" in check.line()
    # A call with no row, a call without an id, an id the upstream got twice: broken.
    assert match_rows({"a": 1, "b": 1, "e": 1}, rows).lost == 1
    assert not match_rows({"a": 1, None: 1}, rows).ok
    twice = match_rows({"a": 2, "b": 1}, rows)
    assert twice.repeated == 1 and not twice.ok


@pytest.mark.integration
@pytest.mark.process
@pytest.mark.slow
def test_bench_soak_smoke_keeps_the_match_rows() -> None:
    report = run_soak(SoakArgs(minutes=0.25, sample_s=5.0, load=0.3))
    assert "-> OK" in report, report
    m = re.search(r"upstream calls (\d+), ledger rows \d+: (\d+) calls matched to their row by id, 0 without a row, "
                  r"0 ids seen twice", report)
    assert m is not None and m.group(1) == m.group(2) != "0", report
    assert re.search(r"fd growth [+-]\d+\.\d%", report), report
