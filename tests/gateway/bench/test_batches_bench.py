"""Smoke test for `tiergate bench batches` (so the bench does not rot): a tiny batch on 1 and on
2 real Celery workers (RabbitMQ) against the mock upstream with a fixed latency; both runs
complete every line and the report prints the ratio. No timing is asserted."""

from __future__ import annotations

import re

import pytest

from gateway.bench.batches import BatchBenchArgs, run_batches_bench


@pytest.mark.process
@pytest.mark.slow
def test_bench_batches_runs_both_and_prints_the_ratio(rabbitmq_url: str) -> None:
    report = run_batches_bench(BatchBenchArgs(lines=8, delay_ms=50, workers=2, concurrency=2, chunk_lines=2,
                                              broker_url=rabbitmq_url))
    assert report.count("completed 8/8, failed 0") == 2, report
    assert re.search(r"ratio 2 workers / 1 worker: \d+\.\d\d", report), report
