"""In-process CPU cost of the observability per request (part of `tiergate bench gateway`).

The same app (``create_app``: auth, routing, the journaled ledger on SQLite) is built once per
variant, each over its own database, all calling the same mock upstream over loopback HTTP. Each
variant answers ``requests`` sequential chat requests through its ASGI interface (httpx's
``ASGITransport``, no server in between) per round, the variants interleaved round by round;
the cost is the CPU time of the calling thread (``time.thread_time``: the event loop runs the
whole request in it) per request. CPU time rather than wall time: while the request waits for
the upstream the thread uses none, and other processes on a shared machine do not add to it.
Reported: each variant's median µs of CPU per request and its spread over the rounds, and the
median of the per-round differences to ``off`` (metrics and tracing off), i.e. what metrics and
tracing add per request. Work done in other threads (the span exporter's batches, the ledger's
database flushes) is not counted here.

Variants: ``off``; ``metrics`` (the default: Prometheus metrics on, tracing off);
``traced`` (metrics on, every request's spans recorded and handed to a BatchSpanProcessor whose
exporter discards them: what is left is the in-process cost, no network); ``traced@R`` (the
same with ``sample_ratio`` R: a sampled-out request's spans are not recorded).

Bench-only: imported lazily by gateway.bench.gateway.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

REQUEST = {"model": "low", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16}


class _Discard(SpanExporter):
    """Takes each batch and drops it (the in-process cost without an exporter's network I/O)."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


@dataclass(frozen=True)
class Variant:
    name: str
    metrics: bool
    sample_ratio: float | None  # None: tracing off


@dataclass(frozen=True)
class CostResult:
    variant: str
    us_per_request: float  # median over the rounds
    spread_us: tuple[float, float]  # min, max over the rounds
    added_us: float  # median over the rounds of (this variant - off), same round
    added_spread_us: tuple[float, float]
    spans: int  # spans exported (recorded) in all


def variants(ratios: Sequence[float] = (1.0, 0.1, 0.0)) -> list[Variant]:
    out = [Variant("off", False, None), Variant("metrics", True, None)]
    for r in ratios:
        out.append(Variant("traced" if r == 1.0 else f"traced@{r:g}", True, r))
    return out


def _config(home: Path, upstream: str, v: Variant, model_name: str, api_key_env: str | None) -> dict[str, Any]:
    model: dict[str, Any] = {"provider": "openai", "model": model_name, "api_base": upstream, "context_window": 8192,
                             "price": {"input": 0.5, "output": 1.5}}
    if api_key_env:
        model["api_key_env"] = api_key_env
    observability: dict[str, Any] = {"metrics": {"enabled": v.metrics}}
    if v.sample_ratio is not None:
        observability["tracing"] = {"enabled": True, "exporter": "none", "sample_ratio": v.sample_ratio}
    return {"server": {"log_level": "warning"},
            "database": {"url_env": "TIERGATE_BENCH_OBS_DATABASE_URL",
                         "default_url": f"sqlite:///{home / 'tiergate-bench.db'}"},
            "ledger": {"journal_dir": str(home / "journal"), "durability": "process"},
            "models": {"mock": model}, "observability": observability,
            "tiers": {t: {"model": "mock"} for t in ("none", "minimal", "low", "medium", "high", "xhigh")}}


async def _measure(upstream: str, requests: int, rounds: int, vs: list[Variant], model: str = "mock",
                   api_key_env: str | None = None) -> list[CostResult]:
    import os

    from gateway.app import create_app
    from gateway.auth import generate_key, hash_key
    from gateway.db import migrate
    from gateway.db.queries import add_api_key, create_tenant
    from gateway.db.session import database_url, make_engine, make_session_factory
    from gateway.settings import TracingSettings, settings_from_dict
    from gateway.telemetry import metrics, tracing

    os.environ.setdefault("TIERGATE_BENCH_OBS_DATABASE_URL", "")
    work = Path(tempfile.mkdtemp(prefix="tiergate-obs-cost-"))
    metrics_were_on = metrics.enabled()
    async with AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        stack.callback(tracing.configure, TracingSettings())  # this process's switches as they were
        stack.callback(metrics.configure, metrics_were_on)
        apps: list[tuple[Variant, httpx.AsyncClient, str, Any, TracerProvider | None, _Discard | None]] = []
        for v in vs:
            home = work / v.name.replace("@", "-")
            home.mkdir()
            settings = settings_from_dict(_config(home, upstream, v, model, api_key_env), base_dir=home)
            url = database_url(settings)
            migrate.upgrade(url.render_as_string(hide_password=False))
            engine = make_engine(url)
            raw = generate_key()
            with make_session_factory(engine)() as s, s.begin():
                tenant = create_tenant(s, "bench")
                add_api_key(s, tenant.id, raw, hash_key(raw))
            engine.dispose()
            provider = exporter = None
            if v.sample_ratio is not None:
                provider = tracing.build_provider(settings.observability.tracing)
                exporter = _Discard()
                provider.add_span_processor(BatchSpanProcessor(exporter))
                stack.callback(provider.shutdown)
            app = create_app(settings, tracer_provider=provider)
            await stack.enter_async_context(app.router.lifespan_context(app))
            client = await stack.enter_async_context(httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://tiergate"))
            apps.append((v, client, raw, settings, provider, exporter))

        def activate(v: Variant, settings: Any, provider: TracerProvider | None) -> None:
            # the recording switches are per process: set them for the variant about to run
            metrics.configure(v.metrics)
            tracing.configure(settings.observability.tracing, provider)

        async def batch(client: httpx.AsyncClient, raw: str, n: int) -> None:
            headers = {"Authorization": f"Bearer {raw}"}
            for _ in range(n):
                r = await client.post("/v1/chat/completions", json=REQUEST, headers=headers)
                if r.status_code != 200:
                    raise RuntimeError(f"in-process request failed: {r.status_code} {r.text[:300]}")

        for v, client, raw, settings, provider, _ in apps:  # warm up every path first
            activate(v, settings, provider)
            await batch(client, raw, min(50, requests))
        gc.collect()
        gc.freeze()  # as `tiergate serve` does after startup: full collections skip the startup heap
        per_round: dict[str, list[float]] = {v.name: [] for v in vs}
        for round_no in range(rounds):
            for v, client, raw, settings, provider, _ in apps if round_no % 2 == 0 else apps[::-1]:  # A B, B A
                activate(v, settings, provider)
                t0 = time.thread_time()
                await batch(client, raw, requests)
                per_round[v.name].append((time.thread_time() - t0) / requests * 1e6)
        for _, _, _, _, provider, _ in apps:
            if provider is not None:
                provider.force_flush()
        spans = {v.name: (e.spans if e is not None else 0) for v, _, _, _, _, e in apps}
    base = per_round[vs[0].name]
    results = []
    for v in vs:
        us = per_round[v.name]
        added = [a - b for a, b in zip(us, base, strict=True)]
        results.append(CostResult(v.name, statistics.median(us), (min(us), max(us)), statistics.median(added),
                                  (min(added), max(added)), spans[v.name]))
    return results


def measure(upstream: str, requests: int = 300, rounds: int = 5, vs: list[Variant] | None = None, *,
            model: str = "mock", api_key_env: str | None = None) -> list[CostResult]:
    """Run the in-process measurement against ``upstream`` (an OpenAI-compatible base URL
    serving ``model``; its key in the ``api_key_env`` variable, if it wants one)."""
    return asyncio.run(_measure(upstream, requests, rounds, vs or variants(), model, api_key_env))


def report(results: list[CostResult], requests: int, rounds: int) -> list[str]:
    lines = [f"in-process CPU per request (thread CPU time, {requests} sequential requests through the ASGI app "
             f"per variant and round, {rounds} interleaved rounds; median [min..max]):",
             f"{'variant':<16}{'CPU us/req':>12}{'spread':>22}{'added us':>12}{'added spread':>22}{'spans':>8}"]
    for r in results:
        lines.append(f"{r.variant:<16}{r.us_per_request:>12.1f}{f'[{r.spread_us[0]:.1f}..{r.spread_us[1]:.1f}]':>22}"
                     f"{r.added_us:>+12.1f}"
                     f"{f'[{r.added_spread_us[0]:+.1f}..{r.added_spread_us[1]:+.1f}]':>22}{r.spans:>8}")
    off, off_best = results[0].us_per_request, results[0].spread_us[0]
    parts = [f"{r.variant} {r.added_us / off * 100:+.1f}%" for r in results[1:]]
    lines.append(f"added CPU relative to off ({off:.0f} us/req): " + ", ".join(parts)
                 + " (a CPU-bound server's RPS falls by about this share)")
    best = [f"{r.variant} {r.spread_us[0] - off_best:+.1f} us ({(r.spread_us[0] - off_best) / off_best * 100:+.1f}%)"
            for r in results[1:]]
    lines.append(f"the same from each variant's best round (least disturbed by other load; off {off_best:.0f} us/req): "
                 + ", ".join(best))
    return lines


def main() -> None:
    """``python -m gateway.bench.obs_cost UPSTREAM [REQUESTS] [ROUNDS]`` (for profiling)."""
    import sys

    upstream = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    print("\n".join(report(measure(upstream, n, rounds), n, rounds)))


if __name__ == "__main__":
    main()
