"""`tiergate serve --workers 2` (a real subprocess): each worker writes its own samples, and a
scrape — whichever worker answers it — merges both: the totals equal every request sent, while
each worker's own file holds only its share."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry.tallies import FOLD_INTERVAL_S
from tests.gateway.edge.edge_support import ADMIN, Served, free_port, serve_subprocess
from tests.gateway.scripted_upstream import UPSTREAM_KEY, UPSTREAM_KEY_ENV, Behaviour, ScriptedUpstream

pytestmark = [pytest.mark.process, pytest.mark.slow]  # two uvicorn workers start: ~10 s
N_REQUESTS = 40
ROUTE = "/v1/chat/completions"


@pytest.fixture
def served(tmp_path: Path, redis_url: str, redis_prefix: str) -> Iterator[tuple[Served, Path, int]]:
    samples, port = tmp_path / "metrics", free_port()
    with ScriptedUpstream() as upstream:
        upstream.push(*[Behaviour(hang_s=0.05)] * N_REQUESTS)  # each call takes a while: both workers get some
        # several workers share budget counters only through Redis (serve refuses --workers N without it)
        with serve_subprocess(tmp_path, upstream, env={UPSTREAM_KEY_ENV: UPSTREAM_KEY, "TIERGATE_REDIS_URL": redis_url},
                              args=("--workers", "2"),
                              sections={"observability": {"metrics": {"multiprocess_dir": str(samples), "port": port}},
                                        "redis": {"key_prefix": redis_prefix}}) as s:
            yield s, samples, port


def _chat_count(text: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tiergate_http_requests_total" and s.labels["route"] == ROUTE and s.labels["status"] == "200")


def _per_worker(samples: Path) -> dict[str, float]:
    """Chat requests counted in each worker's own counter file."""
    out = {}
    for path in sorted(samples.glob("counter_*.db")):
        metrics = MultiProcessCollector.merge([str(path)], accumulate=True)
        out[path.stem] = sum(s.value for m in metrics for s in m.samples
                             if s.name == "tiergate_http_requests_total" and s.labels.get("route") == ROUTE)
    return out


def _settled(samples: Path, sent: int) -> dict[str, float]:
    """The per-worker counts once they add up to ``sent``: each worker folds its samples into its
    file every FOLD_INTERVAL_S (gateway.telemetry.tallies), so within about that time; waits 5x
    that at most, then returns what is there."""
    deadline = time.monotonic() + 5 * FOLD_INTERVAL_S
    while True:
        per_worker = _per_worker(samples)
        if sum(per_worker.values()) >= sent or time.monotonic() > deadline:
            return per_worker
        time.sleep(0.05)


def test_two_workers_samples_are_merged(served: tuple[Served, Path, int]) -> None:
    srv, samples, port = served

    def one(_: int) -> int:
        with httpx.Client(base_url=srv.base, timeout=30) as client:  # a new connection each: any worker takes it
            return client.post(ROUTE, headers={"Authorization": f"Bearer {srv.key}"},
                               json={"model": "low", "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 2}).status_code

    # The kernel hands each new connection to one of the workers; on a busy machine one of them can
    # take a whole round, so rounds go on (10 at most) until both workers have served some.
    sent = 0
    with ThreadPoolExecutor(8) as pool:
        for _ in range(10):
            assert set(pool.map(one, range(N_REQUESTS))) == {200}
            sent += N_REQUESTS
            per_worker = _settled(samples, sent)
            if len([n for n in per_worker.values() if n > 0]) == 2:
                break
    assert len([n for n in per_worker.values() if n > 0]) == 2, per_worker  # both workers served some
    assert sum(per_worker.values()) == sent
    pids = set()
    for _ in range(6):  # several scrapes, answered by either worker: each sees every worker's samples
        r = httpx.get(f"{srv.base}/metrics", headers=ADMIN, timeout=10)
        assert r.status_code == 200, r.text
        assert _chat_count(r.text) == sent
        pids |= {s.labels["pid"] for f in text_string_to_metric_families(r.text) for s in f.samples
                 if s.name == "tiergate_worker_up"}
    assert len(pids) == 2
    # the separate metrics port is the supervisor's: the same merged samples, no key
    assert _chat_count(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text) == sent
