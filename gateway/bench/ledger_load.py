"""The serving load of the ledger benches (`tiergate bench ledger`, `tiergate bench dashboard`):
the baseline ledger, the in-process upstream, the GC-pause recorder and one timed phase of chat
requests through the real app's ASGI interface, in either of two shapes:

* *closed loop* (``rate`` None): ``concurrency`` workers each send their next request when the
  last one is answered. The loop runs as fast as the server lets it: at saturation every
  microsecond the server adds per request shows as lost throughput, and (the same thing) as
  latency, since each worker waits behind everyone else's work;
* *open loop* (``rate`` requests/s): requests are sent on a fixed schedule of Poisson arrivals
  (seeded: both kinds of phase get the same schedule), whatever the answers do, and each
  latency is counted from the request's *scheduled* time, so a server that falls behind is
  charged the wait it caused (no coordinated omission). This is the latency a service sees at
  that offered load.

Bench-only (gateway.bench): imports the app lazily.
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from gateway.bench.stalls import Lag, LoopLag


class NullLedger:
    """The baseline: a ledger that keeps nothing."""

    def record(self, entry: Any) -> None:
        pass

    async def begin(self, intent: Any) -> None:
        pass

    async def await_settled(self, timeout_s: float | None = 10.0) -> bool:
        return True

    def record_request(self, rec: Any) -> None:
        pass

    async def wait_durable(self, level: str = "fsync") -> None:
        pass

    async def aflush(self, timeout_s: float | None = 10.0) -> bool:
        return True

    def health(self) -> Any:
        return type("Health", (), {"ok": True})()


class SleepingUpstream:
    """An in-process ChatProvider: answers after ``delay_s`` with fixed usage."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def complete(self, model: Any, body: dict[str, Any], options: Any = None) -> dict[str, Any]:
        await asyncio.sleep(self.delay_s)
        return {"id": "up", "object": "chat.completion", "created": int(time.time()), "model": model.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}}

    def stream(self, model: Any, body: dict[str, Any], options: Any = None) -> Any:
        raise NotImplementedError("the bench does not stream")

    async def aclose(self) -> None:
        pass


class FullCollections:
    """Records the garbage collections while entered, in any thread: each stops the event loop,
    so every in-flight request sees the whole pause. ``pauses_ms``: the full (generation-2)
    ones; ``by_generation``: every collection's pause, per generation."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self.by_generation: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        ms = (time.perf_counter() - self._started) * 1000
        self.by_generation[info["generation"]].append(ms)
        if info["generation"] == 2:
            self.pauses_ms.append(ms)

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> str:
        """``gen0 N, M ms in all, max X ms; gen1 ...``"""
        return "; ".join(f"gen{g} {len(v)}, {sum(v):.0f} ms in all, max {max(v, default=0.0):.1f} ms"
                         for g, v in self.by_generation.items())


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Phase:
    """One timed phase: each request's (start, end) perf_counter times, the time the timed part
    began, and how late the event loop woke a 5 ms sleeper at worst (when, seconds)."""

    kind: str
    round: int
    spans: list[tuple[float, float]]
    origin: float
    loop_lag: Lag
    loop_sched: tuple[float, float] = (0.0, 0.0)  # the loop thread's (s on a CPU, s waiting for one)
    switch_interval_s: float = 0.0  # the GIL switch interval while timed (the app sets it as serve does)
    offered_rps: float | None = None  # open loop: the arrival rate of its schedule (None: closed loop)

    @property
    def latencies(self) -> list[float]:
        return [e - s for s, e in self.spans]

    @property
    def achieved_rps(self) -> float:
        """Requests answered per second: between the first and the last completion in an open loop
        (as the offered rate is between the first and the last arrival, so a loop that keeps up
        shows the same rate whatever its latency), from the start in a closed loop."""
        return achieved_rps(self.spans, self.origin, open_loop=self.offered_rps is not None)


def achieved_rps(spans: list[tuple[float, float]], origin: float, *, open_loop: bool) -> float:
    ends = sorted(e for _, e in spans)
    if not ends:
        return 0.0
    if open_loop:
        return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else 0.0
    return len(ends) / (ends[-1] - origin) if ends[-1] > origin else 0.0


def schedule_rps(due: list[float]) -> float:
    """The arrival rate of a schedule: between its first and its last arrival."""
    return (len(due) - 1) / (due[-1] - due[0]) if len(due) > 1 and due[-1] > due[0] else 0.0


def poisson_schedule(n: int, rate: float, seed: int, origin: float = 0.0) -> list[float]:
    """``n`` arrival times after ``origin``, Poisson at ``rate`` per second, seeded."""
    rng = random.Random(seed)
    due, at = [], origin
    for _ in range(n):
        at += rng.expovariate(rate)
        due.append(at)
    return due


@dataclass(frozen=True)
class Probe:
    """One open-loop probe of a rate: what was offered, what was answered, and whether there was
    a backlog: the median latency of the first and of the last quarter of arrivals, each held
    to the probe's fastest answer (the latency with no queue), so a backlog that grew, and one the
    probe started with and worked off (another process had the cores for a moment), both fail."""

    rate: float  # the rate asked for
    offered_rps: float  # the schedule's own rate
    achieved_rps: float
    first_quarter_p50_s: float
    last_quarter_p50_s: float
    floor_s: float = 0.0  # the fastest answer

    KEEP_UP = 0.98  # achieved at least this share of offered
    BACKLOG = 1.5  # and both quarters' median latency within this many times the fastest answer
    BACKLOG_SLACK_S = 0.005  # plus this (a few ms of queueing on a ~20 ms request is no backlog)

    @property
    def bound_s(self) -> float:
        return self.BACKLOG * self.floor_s + self.BACKLOG_SLACK_S

    @property
    def keeps_up(self) -> bool:
        return (self.achieved_rps >= self.KEEP_UP * self.offered_rps
                and max(self.first_quarter_p50_s, self.last_quarter_p50_s) <= self.bound_s)

    def line(self) -> str:
        verdict = "keeps up" if self.keeps_up else "falls behind"
        return (f"offered {self.offered_rps:.0f}/s, achieved {self.achieved_rps:.0f}/s "
                f"({self.achieved_rps / self.offered_rps:.1%}), median latency first quarter "
                f"{self.first_quarter_p50_s * 1000:.1f} ms, last quarter {self.last_quarter_p50_s * 1000:.1f} ms "
                f"(bound {self.bound_s * 1000:.1f} ms): {verdict}")


def judge_probe(rate: float, spans: list[tuple[float, float]]) -> Probe:
    """A probe's verdict from its spans (scheduled time, completion), pure arithmetic."""
    ordered = sorted(spans)
    q = max(1, len(ordered) // 4)

    def median_latency(part: list[tuple[float, float]]) -> float:
        return sorted(e - s for s, e in part)[len(part) // 2]

    return Probe(rate, schedule_rps([s for s, _ in ordered]), achieved_rps(ordered, 0.0, open_loop=True),
                 median_latency(ordered[:q]), median_latency(ordered[-q:]), min(e - s for s, e in ordered))


def sustainable_rate(probe: Any, start: float, low: float, *, grow: float = 1.25, max_grows: int = 4,
                     steps: int = 4) -> tuple[float, list[Probe]]:
    """The highest rate ``probe`` (rate -> Probe) says the loop keeps up with. ``start`` first;
    while the last rate kept up, ``grow`` times it (at most ``max_grows`` times: the last one is
    returned if all kept up); then ``steps`` bisections of the interval between the highest rate
    that kept up (``low``, assumed, if none did) and the lowest that fell behind. A rate that
    falls behind is probed once more and counts as kept up if the second probe keeps up: a
    disturbance (another process taking the cores for a moment) can only make a probe fall
    behind, never keep up, so one bad probe must not cap the search. If no probed rate kept up,
    ``low`` is probed too. Returns the rate and every probe, in order; raises if even ``low``
    falls behind."""
    probes: list[Probe] = []

    def keeps_up(rate: float) -> bool:
        probes.append(probe(rate))
        if not probes[-1].keeps_up:
            probes.append(probe(rate))
        return probes[-1].keeps_up

    good: float = start
    bad: float | None = None
    if not keeps_up(start):
        good, bad = low, start
    else:
        for _ in range(max_grows):
            if not keeps_up(good * grow):
                bad = good * grow
                break
            good *= grow
        else:
            return good, probes
    for _ in range(steps):
        mid = (good + bad) / 2
        if keeps_up(mid):
            good = mid
        else:
            bad = mid
    if not any(p.keeps_up for p in probes) and not keeps_up(low):
        raise RuntimeError(f"the open loop falls behind even at {low:.0f} requests/s: "
                           + "; ".join(p.line() for p in probes))
    return good, probes


def release_response(response: Any) -> None:
    """Free an answered ``httpx.Response`` at once instead of at the next garbage collection.

    httpx (0.28) binds every response's stream back to the response (``Response.stream`` is a
    ``BoundAsyncStream`` whose ``_response`` is the response), so each response, with its request,
    URL, headers and stream, ~31 container objects, is a reference cycle only the collector frees.
    The bench's in-process client makes one per request on the event loop it shares with the
    server: at ~1,000 requests/s that alone set off a young-generation collection every ~300
    requests (count-driven at 10,000 net new objects, as servers collected before
    gateway.web.gc_pacing), each stopping the loop
    for every request in flight, 7 ms on average and up to 27 ms (the ledger bench's "all garbage
    collections" line, both kinds of phase). The server itself leaves no cycles behind a request
    (``tests/gateway/bench/test_ledger_load.py``). Breaking the one back-reference once the body is
    read lets reference counting free the whole response: the harness stops pausing the server it
    measures. A response already read and closed is never used through its stream again."""
    stream = getattr(response, "stream", None)
    if stream is not None and getattr(stream, "_response", None) is response:
        stream._response = None


async def serve_phase(app: Any, key: str, n: int, concurrency: int, pauses: FullCollections,
                      kind: str = "", round_: int = 0, rate: float | None = None, seed: int = 0) -> Phase:
    """One timed phase of ``n`` chat requests (after a 20-request warm-up): closed loop with
    ``concurrency`` workers, or open loop at ``rate`` requests/s (Poisson arrivals from
    ``seed``; at most ``OPEN_LOOP_MAX_IN_FLIGHT`` in flight, later arrivals wait for a slot and
    their wait counts)."""
    import httpx

    body = {"model": "low", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    headers = {"Authorization": f"Bearer {key}"}
    spans: list[tuple[float, float]] = []
    lag = LoopLag()
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
        async def one(t0: float) -> None:
            r = await client.post("/v1/chat/completions", json=body, headers=headers)
            spans.append((t0, time.perf_counter()))
            if r.status_code != 200:
                raise RuntimeError(f"bench request failed: {r.status_code} {r.text[:200]}")
            release_response(r)

        for _ in range(WARM_UP):
            await client.post("/v1/chat/completions", json=body, headers=headers)
        origin = time.perf_counter()
        offered: float | None = None
        switch_s = sys.getswitchinterval()
        lag.start(origin)
        try:
            with pauses:
                if rate is None:
                    queue = list(range(n))

                    async def worker() -> None:
                        while queue:
                            queue.pop()
                            await one(time.perf_counter())

                    await asyncio.gather(*(worker() for _ in range(concurrency)))
                else:
                    offered = await _open_loop(one, n, rate, seed, origin)
        finally:
            await lag.stop()
    return Phase(kind, round_, spans, origin, lag.worst(), lag.totals(), switch_s, offered)


OPEN_LOOP_MAX_IN_FLIGHT = 1024
WARM_UP = 20  # requests each phase sends before its timed part


async def _open_loop(one: Any, n: int, rate: float, seed: int, origin: float) -> float:
    """Sends the schedule; returns its arrival rate (``schedule_rps``)."""
    due = poisson_schedule(n, rate, seed, origin)
    slots = asyncio.Semaphore(OPEN_LOOP_MAX_IN_FLIGHT)
    tasks: list[asyncio.Task[None]] = []

    async def scheduled(t0: float) -> None:
        async with slots:
            await one(t0)

    for t0 in due:
        wait = t0 - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(scheduled(t0)))  # latency from the scheduled time, not the send
    await asyncio.gather(*tasks)
    return schedule_rps(due)
