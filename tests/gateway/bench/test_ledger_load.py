"""The ledger benches' open loop: requests go out on a seeded Poisson schedule whatever the
answers do, and a server that falls behind is charged from each request's *scheduled* time (no
coordinated omission); and the rate-finding the open loops are scaled from."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.bench.ledger_load import Probe, _open_loop, judge_probe, poisson_schedule, sustainable_rate


def _run(rate: float, n: int, service_s: float, seed: int = 0) -> tuple[list[float], list[float]]:
    """(scheduled offsets, latencies from the scheduled time) against a server that answers one
    request at a time, each in ``service_s``."""
    scheduled: list[float] = []
    latencies: list[float] = []

    async def main() -> None:
        server = asyncio.Lock()
        origin = time.perf_counter()

        async def one(t0: float) -> None:
            async with server:
                await asyncio.sleep(service_s)
            scheduled.append(t0 - origin)
            latencies.append(time.perf_counter() - t0)

        await _open_loop(one, n, rate, seed, origin)

    asyncio.run(main())
    return sorted(scheduled), latencies


def test_the_schedule_is_seeded_poisson_at_the_rate() -> None:
    a, _ = _run(rate=2000.0, n=200, service_s=0.0)
    b, _ = _run(rate=2000.0, n=200, service_s=0.0)
    assert a == b  # same seed, same schedule: both kinds of phase get the same arrivals
    assert 0.05 < a[-1] < 0.2  # 200 arrivals at 2000/s: ~0.1 s
    c, _ = _run(rate=2000.0, n=200, service_s=0.0, seed=1)
    assert c != a


def test_a_server_that_falls_behind_is_charged_from_the_scheduled_time() -> None:
    # 100 arrivals at 1000/s into a server that takes 5 ms each: the queue grows by ~4 ms per
    # arrival, so the last requests wait ~0.4 s, though each one's own service is 5 ms.
    _, latencies = _run(rate=1000.0, n=100, service_s=0.005)
    assert max(latencies) > 0.25
    assert min(latencies) < 0.05


# The open-loop capacity the bench scales its open loops from (sustainable_rate, judge_probe),
# against a simulated server: one request at a time takes 1/capacity of its CPU, then a fixed
# 20 ms upstream wait overlaps with the others' (pure arithmetic, no event loop, no database).

def _simulated_probe(capacity: float, upstream_s: float = 0.02, seconds: float = 3.0,
                     disturbed: tuple[int, ...] = ()) -> Any:
    """``disturbed``: the probes (by number, from 0) during which the server runs at a third of
    its capacity (another process took the cores)."""
    rates: list[float] = []

    def probe(rate: float) -> Probe:
        rates.append(rate)
        speed = capacity / 3 if len(rates) - 1 in disturbed else capacity
        due = poisson_schedule(max(200, int(rate * seconds)), rate, seed=len(rates))
        spans, free = [], 0.0
        for t0 in due:
            free = max(free, t0) + 1 / speed
            spans.append((t0, free + upstream_s))
        return judge_probe(rate, spans)

    probe.rates = rates  # type: ignore[attr-defined]
    return probe


def test_a_probe_keeps_up_below_capacity_and_falls_behind_above_it() -> None:
    probe = _simulated_probe(1000.0)
    below = probe(700.0)
    assert below.keeps_up, below.line()
    assert below.achieved_rps == pytest.approx(below.offered_rps, rel=0.02)
    above = probe(1100.0)
    assert not above.keeps_up, above.line()
    assert above.achieved_rps == pytest.approx(1000.0, rel=0.02)  # the server's own rate, not the offered
    assert above.last_quarter_p50_s > 3 * above.first_quarter_p50_s  # the backlog grew
    assert "falls behind" in above.line() and "keeps up" in below.line()


def test_a_probe_that_starts_behind_does_not_keep_up_though_it_catches_up() -> None:
    # 600 arrivals at 1000/s into a server of 1500/s (20 ms upstream) that is stopped for the first
    # 100 ms: it answers every one and works the backlog off within the first quarter's arrivals,
    # but that quarter's median waited; the same schedule undisturbed keeps up
    due = poisson_schedule(600, 1000.0, seed=3)

    def served(stopped_s: float) -> list[tuple[float, float]]:
        spans, free = [], stopped_s
        for t0 in due:
            free = max(free, t0) + 1 / 1500
            spans.append((t0, free + 0.02))
        return spans

    late = judge_probe(1000.0, served(0.1))
    assert late.achieved_rps >= Probe.KEEP_UP * late.offered_rps
    assert late.last_quarter_p50_s < late.bound_s < late.first_quarter_p50_s
    assert not late.keeps_up, late.line()
    assert judge_probe(1000.0, served(0.0)).keeps_up


def _failed_twice(probes: list[Probe]) -> None:
    """Every rate that fell behind was probed again at once."""
    for i, p in enumerate(probes):
        if not p.keeps_up and (i == 0 or probes[i - 1].rate != p.rate or probes[i - 1].keeps_up):
            assert i + 1 < len(probes) and probes[i + 1].rate == p.rate, [(q.rate, q.keeps_up) for q in probes]


def test_the_sustainable_rate_is_found_below_the_start_by_bisection() -> None:
    probe = _simulated_probe(1000.0)
    rate, probes = sustainable_rate(probe, 1100.0, 200.0, steps=5)
    assert probe.rates[:4] == [1100.0, 1100.0, 650.0, 875.0]  # the start fell behind (twice): bisect [low, start]
    assert [p.rate for p in probes] == probe.rates
    assert len({p.rate for p in probes}) == 6  # the start and 5 bisections
    _failed_twice(probes)
    assert 900.0 <= rate <= 1030.0  # within the bisection's step (28/s) and the probes' noise
    assert any(p.rate == rate and p.keeps_up for p in probes)
    # the highest rate that kept up is returned, and every rate above it that was probed fell behind
    assert all(not p.keeps_up for p in probes if p.rate > rate)


def test_the_sustainable_rate_is_found_above_the_start_by_growing_then_bisecting() -> None:
    probe = _simulated_probe(1000.0)
    rate, probes = sustainable_rate(probe, 600.0, 100.0, grow=1.25, steps=4)
    assert probe.rates[:5] == [600.0, 750.0, 937.5, 1171.875, 1171.875]  # x1.25 until one falls behind (twice)
    assert [p.keeps_up for p in probes[:5]] == [True, True, True, False, False]
    assert len({p.rate for p in probes}) == 8
    _failed_twice(probes)
    assert 937.5 <= rate <= 1030.0
    assert all(not p.keeps_up for p in probes if p.rate > rate)


def test_one_disturbed_probe_does_not_cap_the_search() -> None:
    # the second probe (750/s) runs while the server has a third of its speed: it falls behind,
    # is probed again undisturbed, keeps up, and the search goes on growing
    probe = _simulated_probe(1000.0, disturbed=(1,))
    rate, probes = sustainable_rate(probe, 600.0, 100.0, grow=1.25, steps=4)
    assert probe.rates[:4] == [600.0, 750.0, 750.0, 937.5]
    assert [p.keeps_up for p in probes[:4]] == [True, False, True, True]
    assert 937.5 <= rate <= 1030.0


def test_the_sustainable_rate_stops_growing_after_max_grows() -> None:
    probe = _simulated_probe(1000.0)
    rate, probes = sustainable_rate(probe, 100.0, 50.0, grow=1.5, max_grows=2)
    assert rate == 225.0 and probe.rates == [100.0, 150.0, 225.0] and all(p.keeps_up for p in probes)


def test_no_sustainable_rate_in_the_range_raises() -> None:
    probe = _simulated_probe(100.0)
    with pytest.raises(RuntimeError, match="falls behind even at 200 requests/s"):
        sustainable_rate(probe, 1100.0, 200.0, steps=3)
    # each rate twice, the low end itself last, before giving up
    assert probe.rates == [1100.0, 1100.0, 650.0, 650.0, 425.0, 425.0, 312.5, 312.5, 200.0, 200.0]


# The harness's own garbage: the bench's in-process client must not make the server it measures
# pause for garbage collections (release_response), and the server must leave no reference cycles
# behind a request (a cycle is freed only by a collection, which stops the event loop).

def _cycle_garbage_per_request(tmp_path: Any, *, release: bool, n: int = 64) -> float:
    import gc

    import httpx

    from gateway.app import create_app
    from gateway.auth import KeyStore
    from gateway.bench.ledger_load import SleepingUpstream, release_response
    from gateway.bench.ledger_pg import _settings
    from gateway.ledger import Ledger
    from gateway.runtime import RuntimeParts
    from tests.gateway.gateway_harness import make_database

    url, sf, _, raw = make_database(tmp_path)
    ledger = Ledger(sf, tmp_path / "journal")
    ledger.start()
    app = create_app(_settings(tmp_path, url), RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf),
                                                            local_provider=SleepingUpstream(0.0)))
    body = {"model": "low", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    headers = {"Authorization": f"Bearer {raw}"}
    found: list[int] = []

    async def run() -> None:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
            async def one() -> None:
                r = await client.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 200, r.text
                if release:
                    release_response(r)

            for _ in range(20):  # warm: first-use caches are not per-request garbage
                await one()
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection would free is kept in gc.garbage
            try:
                for _ in range(n // 8):
                    await asyncio.gather(*(one() for _ in range(8)))
                gc.collect()
                found.append(len(gc.garbage))
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()

    try:
        asyncio.run(run())
    finally:
        assert ledger.stop()
    return found[0] / n


@pytest.mark.slow
def test_the_server_leaves_no_reference_cycles_behind_a_request(tmp_path: Any) -> None:
    # The chat route with the journaled ledger, answered through the bench's client as the ledger
    # bench drives it: nothing left for the collector (a handful of one-off objects at most).
    assert _cycle_garbage_per_request(tmp_path, release=True) < 1.0


@pytest.mark.slow
def test_without_release_each_httpx_response_is_a_cycle(tmp_path: Any) -> None:
    # What release_response is for: httpx binds each response's stream back to the response, so an
    # answered response (with its request, URL and headers) waits for a collection.
    assert _cycle_garbage_per_request(tmp_path, release=False) >= 10.0
