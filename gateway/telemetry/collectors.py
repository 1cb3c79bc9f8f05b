"""Scrape-time collectors for ``GET /metrics``: state read when Prometheus asks, not counted on
the request path.

* ``BatchLinesCollector``: batch lines by state, from the database (one grouped count per
  scrape; the same for every worker, so it is collected by whichever answers the scrape).
* ``EngineCollector``: the bundled engine's running and waiting sequences, KV-cache block usage
  and preemptions, for each engine this process has loaded (labelled by model directory).

Imports prometheus_client, sqlalchemy and the jobs table only; used only by gateway.routes.metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from sqlalchemy.orm import Session, sessionmaker

from gateway.db.models import BatchLine

LINE_STATES = ("pending", "running", "done", "cancelled", "expired")


class BatchLinesCollector:
    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self.session_factory = session_factory

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("tiergate_batch_lines", "Batch lines by state (from the database).",
                                   labels=["state"])
        with self.session_factory() as s:
            counts = dict(s.execute(sa.select(BatchLine.state, sa.func.count()).group_by(BatchLine.state)).all())
        for state in sorted(set(LINE_STATES) | set(counts)):
            family.add_metric([state], float(counts.get(state, 0)))
        yield family


class EngineCollector:
    """``engines()``: this process's loaded engines by name (an ``AsyncLLMEngine`` each)."""

    def __init__(self, engines: Callable[[], dict[str, Any]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily("tiergate_engine_running_sequences", "Sequences being decoded.", labels=["model"])
        waiting = GaugeMetricFamily("tiergate_engine_waiting_sequences", "Sequences queued for admission.",
                                    labels=["model"])
        kv = GaugeMetricFamily("tiergate_engine_kv_blocks_used_ratio", "Share of KV-cache blocks in use (0-1).",
                               labels=["model"])
        preempted = GaugeMetricFamily("tiergate_engine_preemptions", "Sequences preempted since the engine started.",
                                      labels=["model"])
        for name, async_engine in sorted(self.engines().items()):
            engine = async_engine.engine
            scheduler, allocator = engine.scheduler, engine.allocator
            running.add_metric([name], float(len(scheduler.running)))
            waiting.add_metric([name], float(len(scheduler.waiting)))
            kv.add_metric([name], 1.0 - allocator.num_free / allocator.num_blocks if allocator.num_blocks else 0.0)
            preempted.add_metric([name], float(scheduler.num_preemptions))
        yield from (running, waiting, kv, preempted)
