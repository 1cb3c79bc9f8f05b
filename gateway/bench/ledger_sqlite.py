"""`tiergate bench ledger-sqlite`: ledger write throughput against a naive baseline, in one run.

Baseline: what a gateway without a ledger service does — one DB transaction per upstream call
(run off the event loop, same concurrency). Measured against it on the same fresh database:
``record_durable`` (group-commit fsync to the journal, DB behind it) and plain ``record``
(non-blocking), both until everything is committed. Prints rows/s and the ratios, plus the
p50/p99 latency of ``record_durable`` at concurrency 1 (≈ one fsync).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path


def _entries(n: int, tag: str) -> list:  # type: ignore[type-arg]
    from gateway.ledger import LedgerEntry
    from gateway.providers.base import Usage

    return [LedgerEntry(id=f"{tag}-{i}", request_id=f"req-{tag}-{i}", tenant_id="bench", key_id="k",
                        stage="direct", tier="low", model="demo-moe", usage=Usage(100, 20, 10, 0),
                        cost_nanos=100_000, baseline_cost_nanos=1_000_000) for i in range(n)]


async def _bounded(items: list, concurrency: int, fn) -> None:  # type: ignore[no-untyped-def, type-arg]
    sem = asyncio.Semaphore(concurrency)

    async def one(x):  # type: ignore[no-untyped-def]
        async with sem:
            await fn(x)

    await asyncio.gather(*(one(x) for x in items))


async def _run(workdir: Path, n: int, concurrency: int) -> dict[str, float]:
    from gateway.db import migrate
    from gateway.db.session import make_engine, make_session_factory
    from gateway.ledger import Ledger
    from gateway.ledger.applier import write_batch

    url = f"sqlite:///{workdir}/bench.db"
    migrate.upgrade(url)
    engine = make_engine(url)
    factory = make_session_factory(engine)
    out: dict[str, float] = {}

    t = time.perf_counter()
    await _bounded(_entries(n, "naive"), concurrency,
                   lambda e: asyncio.to_thread(write_batch, factory, [e]))
    out["naive"] = n / (time.perf_counter() - t)

    ledger = Ledger(factory, workdir / "journal")
    ledger.start()
    t = time.perf_counter()
    await _bounded(_entries(n, "durable"), concurrency, ledger.record_durable)
    out["durable_ack"] = n / (time.perf_counter() - t)
    await ledger.aflush(60)
    out["durable_committed"] = n / (time.perf_counter() - t)

    t = time.perf_counter()
    for e in _entries(n, "plain"):
        ledger.record(e)
    out["record_call_us"] = (time.perf_counter() - t) / n * 1e6
    await ledger.aflush(60)
    out["plain_committed"] = n / (time.perf_counter() - t)

    latencies = []
    for e in _entries(200, "lat"):
        t = time.perf_counter()
        await ledger.record_durable(e)
        latencies.append((time.perf_counter() - t) * 1000)
    latencies.sort()
    out["durable_p50_ms"] = statistics.median(latencies)
    out["durable_p99_ms"] = latencies[int(len(latencies) * 0.99) - 1]
    await ledger.astop()
    engine.dispose()
    return out


def run(n: int, concurrency: int) -> list[str]:
    """Ledger rows/s: naive per-call transaction vs record_durable vs record (SQLite, temp dir);
    the report's lines."""
    with tempfile.TemporaryDirectory(prefix="tiergate-bench-ledger-") as tmp:
        r = asyncio.run(_run(Path(tmp), n, concurrency))
    return [
        f"ledger bench: {n} entries per variant, concurrency {concurrency}, SQLite in a temp dir",
        f"  naive: 1 transaction per call      {r['naive']:10.0f} rows/s   (baseline)",
        f"  record_durable, acknowledged        {r['durable_ack']:10.0f} rows/s   "
        f"x{r['durable_ack'] / r['naive']:.1f}",
        f"  record_durable, all committed       {r['durable_committed']:10.0f} rows/s   "
        f"x{r['durable_committed'] / r['naive']:.1f}",
        f"  record (non-blocking), committed    {r['plain_committed']:10.0f} rows/s   "
        f"x{r['plain_committed'] / r['naive']:.1f}   ({r['record_call_us']:.1f} us per record() call)",
        f"  record_durable latency, concurrency 1: p50 {r['durable_p50_ms']:.2f} ms, "
        f"p99 {r['durable_p99_ms']:.2f} ms",
    ]
