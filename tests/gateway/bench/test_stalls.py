"""The serving benches' stall detector: the longest interval with requests in flight and none
completing, which requests overlapped it, the per-phase line ``tiergate bench ledger`` prints,
and the event-loop lag sampler."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from gateway.bench.ledger_pg import Phase, busy_line, phase_line
from gateway.bench.stalls import Lag, LoopLag, Stall, longest_stall, overlapping, thread_sched


def test_longest_stall_is_the_longest_gap_between_completions_with_requests_in_flight() -> None:
    # completions at 1, 1.5, 4 and 4.1; from 1.5 to 4 two requests are in flight and none ends
    spans = [(0.0, 1.0), (0.5, 1.5), (1.2, 4.0), (1.3, 4.1)]
    assert longest_stall(spans) == Stall(start_s=1.5, duration_s=2.5, in_flight=2)
    assert longest_stall(list(reversed(spans))) == Stall(1.5, 2.5, 2)  # order of the spans does not matter


def test_time_with_nothing_in_flight_is_not_a_stall() -> None:
    # idle from 1 to 3: the longest stall is the first request's own second, not the idle gap
    assert longest_stall([(0.0, 1.0), (3.0, 3.5)]) == Stall(0.0, 1.0, 1)


def test_stall_is_measured_from_the_origin() -> None:
    spans = [(10.0, 10.2), (10.0, 10.3), (10.1, 10.9), (10.2, 10.9)]
    stall = longest_stall(spans, origin=10.0)
    assert stall is not None
    assert stall.start_s == pytest.approx(0.3) and stall.duration_s == pytest.approx(0.6)
    assert stall.in_flight == 2  # both requests that completed at 10.9


def test_no_requests_no_stall() -> None:
    assert longest_stall([]) is None
    assert longest_stall([(1.0, 1.0)]) == Stall(1.0, 0.0, 0)


def test_overlapping_marks_the_requests_in_flight_during_the_window() -> None:
    spans = [(0.0, 1.0), (0.5, 1.5), (1.2, 4.0), (4.0, 4.1)]
    assert overlapping(spans, Stall(1.5, 2.5, 1)) == [False, False, True, False]
    assert overlapping(spans, Stall(0.5, 1.0, 2), origin=0.5) == [False, True, True, False]


def test_phase_line_reports_the_p99_with_and_without_the_stall_window() -> None:
    # 100 requests of 10 ms, one after another, then 5 together that wait 200 ms
    spans = [(i * 0.01, (i + 1) * 0.01) for i in range(100)] + [(1.0, 1.2)] * 5
    line = phase_line(Phase("off", 2, spans, 0.0, Lag(1.05, 0.19, 0.03, 0.15), (0.6, 0.25)))
    # a closed loop's line: 105 answers in 1.2 s
    assert re.search(r"round 2 ledger off: achieved 88/s, p99 ", line), line
    m = re.search(r"round 2 ledger off: achieved \d+/s, p99 +([\d.]+) ms, ([\d.]+) ms without its longest stall: (\d+) ms at "
                  r"([\d.]+) s \((\d+) in flight\); loop lag max (\d+) ms at ([\d.]+) s \(loop thread meanwhile: "
                  r"(\d+) ms on a CPU, (\d+) ms waiting for one\); phase ([\d.]+) s, loop thread ([\d.]+) s on a "
                  r"CPU, ([\d.]+) s waiting for one", line)
    assert m is not None, line
    assert float(m.group(1)) == pytest.approx(200.0)
    assert float(m.group(2)) == pytest.approx(10.0)
    assert m.groups()[2:] == ("200", "1.00", "5", "190", "1.05", "30", "150", "1.20", "0.60", "0.25")
    # an open loop's line also says what its schedule offered; achieved counts from the first answer
    # to the last (104 more in 1.19 s), as offered counts from the first arrival to the last
    opened = phase_line(Phase("on", 1, spans, 0.0, Lag(0, 0), (0.6, 0.25), offered_rps=100.0))
    assert re.search(r"round 1 ledger on: +offered 100/s, achieved 87/s, p99 +200\.00 ms", opened), opened


def test_loop_lag_sees_a_blocked_loop() -> None:
    async def main() -> LoopLag:
        lag = LoopLag(interval_s=0.005)
        lag.start(time.perf_counter())
        await asyncio.sleep(0.02)  # the sampler is sleeping when the loop blocks
        time.sleep(0.05)  # blocks the loop: the sampler, due within 5 ms, wakes >= 45 ms late
        await asyncio.sleep(0.02)
        await lag.stop()
        return lag

    lag = asyncio.run(main())
    worst = lag.worst()
    assert worst.lag_s >= 0.04 and worst.at_s >= 0.0
    assert len(lag.samples) >= 2


@pytest.mark.skipif(thread_sched() is None, reason="no /proc/thread-self/schedstat (not Linux)")
def test_loop_lag_tells_a_busy_loop_thread_from_a_blocked_one() -> None:
    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    async def main(block: object) -> LoopLag:
        lag = LoopLag(interval_s=0.005)
        lag.start(time.perf_counter())
        await asyncio.sleep(0.02)
        block(0.05)  # type: ignore[operator]
        await asyncio.sleep(0.02)
        await lag.stop()
        return lag

    # spinning, the loop thread is on a CPU or waiting for one the whole time, so those two
    # cover most of the late wake-up (not all of it on a VM: time the hypervisor gave the vCPU to
    # another guest is in neither; a clean-clone CI run saw 37.6 + 7.0 ms of a 49.5 ms lag);
    # sleeping, it is on neither
    busy = asyncio.run(main(spin)).worst()
    assert busy.lag_s >= 0.04 and busy.on_cpu_s + busy.run_queue_s >= 0.03
    blocked = asyncio.run(main(time.sleep))
    assert blocked.worst().lag_s >= 0.04 and blocked.worst().on_cpu_s < 0.04  # asleep: not on a CPU
    cpu_s, queued_s = blocked.totals()
    assert cpu_s == pytest.approx(sum(s.on_cpu_s for s in blocked.samples))  # the samples add up to the totals
    assert queued_s == pytest.approx(sum(s.run_queue_s for s in blocked.samples))


def test_busy_line_flags_ledger_off_phases_whose_loop_waited_for_a_cpu() -> None:
    spans = [(0.0, 1.0)]  # one-second phases
    quiet = [Phase("off", 1, spans, 0.0, Lag(0, 0), (0.5, 0.05)), Phase("on", 1, spans, 0.0, Lag(0, 0), (0.6, 0.2))]
    line = busy_line(quiet)
    assert "ledger off 5%, ledger on 20% (ledger-off phases within 10%)" in line, line
    busy = [*quiet, Phase("off", 2, spans, 0.0, Lag(0, 0), (0.5, 0.4))]
    line = busy_line(busy)
    assert "ledger off 40%" in line and "BUSY MACHINE: 1 ledger-off phase(s) above 10%" in line, line
