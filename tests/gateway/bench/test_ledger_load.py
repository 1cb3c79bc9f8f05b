"""The ledger benches' open loop: requests go out on a seeded Poisson schedule whatever the
answers do, and a server that falls behind is charged from each request's *scheduled* time (no
coordinated omission)."""

from __future__ import annotations

import asyncio
import time

from gateway.bench.ledger_load import _open_loop


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
