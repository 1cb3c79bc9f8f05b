"""In-process CPU cost of the observability per request (part of `tiergate bench gateway`).

The same app (``create_app``: auth, routing, the journaled ledger on SQLite) is built once per
variant as ``tiergate serve`` builds it (``freeze_heap=True``: startup heap frozen, a server's
threshold for the youngest GC generation and GIL switch interval; at Python's default threshold of
700 a traced variant's spans, queued in the BatchSpanProcessor until their batch is exported,
lived through young collections and set off full ones that a server's settings avoid), each over
its own database, all calling the same mock upstream over loopback HTTP. Each variant answers
``requests`` sequential chat requests through its ASGI interface (httpx's ``ASGITransport``, no
server in between) per round, the variants interleaved round by round; the cost is the CPU time of
the calling thread (``time.thread_time``: the event loop runs the whole request in it) per request.
CPU time rather than wall time: while the request waits for
the upstream the thread uses none, and other processes on a shared machine do not add to it.
Reported: each variant's median µs of CPU per request and its spread over the rounds, and the
median of the per-round differences to ``off`` (metrics and tracing off), i.e. what metrics and
tracing add per request; and, counted once more per variant under cProfile after the timed
rounds, the Python function calls per request in the same thread: a count, so the same from run
to run however loaded the machine is, where the times on a shared machine swing by ±10%. Work done in other threads (the span exporter's batches, the ledger's
database flushes) is not counted here.

Variants: ``off``; ``metrics`` (the default: Prometheus metrics on, tracing off);
``traced`` (metrics on, every request's spans recorded and handed to a BatchSpanProcessor whose
exporter discards them: what is left is the in-process cost, no network); ``traced@R`` (the
same with ``sample_ratio`` R: a sampled-out request's spans are not recorded; 0.1 is the
default ratio once tracing is enabled).

The report puts each variant against the targets (RPS at most 5% lower: a CPU-bound server's
RPS falls by the added CPU's share; p50 at most 0.1 ms higher: a sequential request's added
latency is its added CPU, which all runs on the event loop's thread) and against the
OpenTelemetry SDK's own floor (``sdk_floor``: a bare loop of ``start_span``/``end``, with and
without attributes, through the same sampler and BatchSpanProcessor), times the spans and
attributes a traced request records: what no change in tiergate's own code can take away.

Bench-only: imported lazily by gateway.bench.gateway.
"""

from __future__ import annotations

import asyncio
import cProfile
import gc
import pstats
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
        self.spans = self.attributes = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        self.attributes += sum(len(s.attributes or ()) for s in spans)
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
    attributes: int = 0  # attributes on those spans
    requests: int = 0  # requests made in all (warm-up included): spans / requests = spans per request
    calls_per_request: float = 0.0  # Python function calls in the event loop's thread per request (cProfile)

    @property
    def spans_per_request(self) -> float:
        return self.spans / self.requests if self.requests else 0.0

    @property
    def attributes_per_request(self) -> float:
        return self.attributes / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class Floor:
    """The SDK's cost per recorded span (start + end, no attributes) and per attribute on it."""

    span_us: float
    attribute_us: float

    def per_request(self, spans: float, attributes: float) -> float:
        return spans * self.span_us + attributes * self.attribute_us


RPS_TARGET = 0.05  # at most 5% fewer requests per second: added CPU share
P50_TARGET_US = 100.0  # at most 0.1 ms added to the median latency


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
            app = create_app(settings, tracer_provider=provider, freeze_heap=True)  # as `tiergate serve`
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
        calls: dict[str, float] = {}
        counted = min(requests, 50)
        for v, client, raw, settings, provider, _ in apps:  # the steady proxy: calls, not time
            activate(v, settings, provider)
            profiler = cProfile.Profile()
            profiler.enable()
            await batch(client, raw, counted)
            profiler.disable()
            calls[v.name] = sum(row[1] for row in pstats.Stats(profiler).stats.values()) / counted  # type: ignore[attr-defined]
        for _, _, _, _, provider, _ in apps:
            if provider is not None:
                provider.force_flush()
        spans = {v.name: (e.spans if e is not None else 0) for v, _, _, _, _, e in apps}
        attributes = {v.name: (e.attributes if e is not None else 0) for v, _, _, _, _, e in apps}
    base = per_round[vs[0].name]
    results = []
    for v in vs:
        us = per_round[v.name]
        added = [a - b for a, b in zip(us, base, strict=True)]
        results.append(CostResult(v.name, statistics.median(us), (min(us), max(us)), statistics.median(added),
                                  (min(added), max(added)), spans[v.name], attributes[v.name],
                                  min(50, requests) * 2 + requests * rounds, calls[v.name]))
    return results


def measure(upstream: str, requests: int = 100, rounds: int = 30, vs: list[Variant] | None = None, *,
            model: str = "mock", api_key_env: str | None = None) -> list[CostResult]:
    """Run the in-process measurement against ``upstream`` (an OpenAI-compatible base URL
    serving ``model``; its key in the ``api_key_env`` variable, if it wants one)."""
    return asyncio.run(_measure(upstream, requests, rounds, vs or variants(), model, api_key_env))


def sdk_floor(spans: int = 20_000, rounds: int = 5, attributes: int = 12) -> Floor:
    """The OpenTelemetry SDK's own cost (thread CPU µs) of one recorded span, and of one attribute
    on it: a bare loop of ``start_span(...).end()`` through a provider as tiergate builds it
    (sample_ratio 1.0) with a BatchSpanProcessor discarding the batches, without and with
    ``attributes`` attributes (strings, ints, a float, a bool, as a request's), median of
    ``rounds`` interleaved rounds. Spans go out in chunks of 400 with a flush between (not timed),
    so the processor's queue never fills and drops. A hot loop: the floor, not what a span costs
    among a request's other work (caches are colder there)."""
    from opentelemetry.trace import SpanKind

    from gateway.settings import TracingSettings
    from gateway.telemetry import tracing

    provider = tracing.build_provider(TracingSettings(enabled=True, exporter="none", sample_ratio=1.0))
    provider.add_span_processor(BatchSpanProcessor(_Discard()))
    tracer = provider.get_tracer("tiergate-floor")
    attrs: dict[str, Any] = {f"tiergate.floor_{i}": (f"value-{i}" if i % 3 == 0 else i if i % 3 == 1 else i / 3)
                             for i in range(attributes - 1)}
    attrs["tiergate.floor_flag"] = True
    chunk = 400

    def run(with_attributes: bool) -> float:
        a = attrs if with_attributes else None
        used = 0.0
        for _ in range(max(1, spans // chunk)):
            t0 = time.thread_time()
            for _ in range(chunk):
                tracer.start_span("floor", kind=SpanKind.SERVER, attributes=a).end()
            used += time.thread_time() - t0
            provider.force_flush()
        return used / (max(1, spans // chunk) * chunk) * 1e6

    try:
        run(False)  # warm up
        run(True)
        bare, full = [], []
        for _ in range(rounds):
            bare.append(run(False))
            full.append(run(True))
    finally:
        provider.shutdown()
    span_us = statistics.median(bare)
    return Floor(span_us, max(0.0, statistics.median(full) - span_us) / attributes)


def encoding_cost(spans: int = 512, rounds: int = 7) -> tuple[float, float]:
    """Thread CPU µs per span to encode a batch of ``spans`` request-like server spans (16
    attributes: the low-cardinality ones repeating, the request id, tokens and cost varying) for
    OTLP: the OpenTelemetry exporter's encoder (message objects, then serialized) and
    gateway.telemetry.otlp_wire's (the bytes written directly, what tiergate's exporter sends);
    medians of ``rounds`` interleaved rounds. The export thread's work, which the in-process table
    (the event loop's thread) does not count but a CPU-bound server pays through the GIL."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

    from gateway.telemetry.otlp_wire import encode_spans as wire_encode

    resource = Resource.create({"service.name": "tiergate"})

    def attributes(i: int) -> dict[str, Any]:
        return {"http.request.method": "POST", "url.scheme": "http", "url.path": "/v1/chat/completions",
                "http.response.status_code": 200, "http.route": "/v1/chat/completions",
                "gen_ai.operation.name": "chat", "gen_ai.request.model": "low", "tiergate.tier": "low",
                "tiergate.effort": "low", "tiergate.effort_source": "explicit", "tiergate.pipeline": False,
                "tiergate.model": "mock", "tiergate.request_id": f"chatcmpl-{i:032x}",
                "gen_ai.usage.input_tokens": 10 + i % 50, "gen_ai.usage.output_tokens": i % 200,
                "tiergate.cost_usd": 1.5e-05 * (i % 97)}

    batch = [ReadableSpan("POST /v1/chat/completions", SpanContext((1 << 100) | i, i + 1, False, TraceFlags(3)),
                          None, resource, attributes(i), kind=SpanKind.SERVER, start_time=i, end_time=i + 1000)
             for i in range(spans)]

    def timed(encode: Any) -> float:
        t0 = time.thread_time()
        encode(batch)
        return (time.thread_time() - t0) / spans * 1e6

    sdk, wire = [], []
    for _ in range(rounds):
        sdk.append(timed(lambda b: sdk_encode(b).SerializePartialToString()))
        wire.append(timed(wire_encode))
    return statistics.median(sdk), statistics.median(wire)


def _added_calls(r: CostResult, off: CostResult) -> str:
    """The variant's added Python calls per request as a share of off's (counted: no noise)."""
    if not off.calls_per_request:
        return "-"
    return f"{(r.calls_per_request - off.calls_per_request) / off.calls_per_request * 100:+.1f}%"


def _verdict(r: CostResult, off: float) -> str:
    share = r.added_us / off
    rps = "met" if share <= RPS_TARGET else "NOT met"
    p50 = "met" if r.added_us <= P50_TARGET_US else "NOT met"
    return (f"{r.variant}: added {r.added_us:+.1f} us = {share * 100:+.1f}% of off -> RPS target (<= "
            f"{RPS_TARGET * 100:.0f}%) {rps}, added p50 target (<= {P50_TARGET_US / 1000:.1f} ms) {p50}")


def report(results: list[CostResult], requests: int, rounds: int, floor: Floor | None = None,
           encoding: tuple[float, float] | None = None) -> list[str]:
    lines = [f"in-process CPU per request (thread CPU time, {requests} sequential requests through the ASGI app "
             f"per variant and round, {rounds} interleaved rounds; median [min..max]):",
             f"{'variant':<16}{'CPU us/req':>12}{'spread':>22}{'added us':>12}{'added spread':>22}{'% of off':>10}"
             f"{'spans':>8}{'spans/req':>11}{'attrs/req':>11}{'calls/req':>11}{'+calls':>9}"]
    off, off_best = results[0].us_per_request, results[0].spread_us[0]
    for r in results:
        lines.append(f"{r.variant:<16}{r.us_per_request:>12.1f}{f'[{r.spread_us[0]:.1f}..{r.spread_us[1]:.1f}]':>22}"
                     f"{r.added_us:>+12.1f}"
                     f"{f'[{r.added_spread_us[0]:+.1f}..{r.added_spread_us[1]:+.1f}]':>22}"
                     f"{r.added_us / off * 100:>+9.1f}%{r.spans:>8}{r.spans_per_request:>11.2f}"
                     f"{r.attributes_per_request:>11.1f}{r.calls_per_request:>11.0f}{_added_calls(r, results[0]):>9}")
    best = [f"{r.variant} {r.spread_us[0] - off_best:+.1f} us ({(r.spread_us[0] - off_best) / off_best * 100:+.1f}%)"
            for r in results[1:]]
    lines.append(f"the same from each variant's best round (least disturbed by other load; off {off_best:.0f} us/req): "
                 + ", ".join(best))
    lines.append(f"verdict vs the targets (added CPU share of off's {off:.0f} us/req ~ the RPS a CPU-bound server "
                 "loses; added CPU ~ added p50 of a sequential request; '+calls': the added Python calls per "
                 "request, counted, the steady proxy of the same share when other load makes the times swing):")
    lines += [f"  {_verdict(r, off)}; added calls {_added_calls(r, results[0])}" for r in results[1:]]
    traced = max(results, key=lambda r: r.spans_per_request)
    if encoding is not None:
        lines.append(f"OTLP encoding in the export thread (512 request-like spans per batch): the OpenTelemetry "
                     f"exporter's {encoding[0]:.1f} us per span, tiergate's (gateway.telemetry.otlp_wire) "
                     f"{encoding[1]:.1f} us per span ({encoding[0] / max(encoding[1], 1e-9):.1f}x less)")
    if floor is not None and traced.spans:
        at = floor.per_request(traced.spans_per_request, traced.attributes_per_request)
        lines.append(f"OpenTelemetry SDK floor (hot loop of start_span/end, same sampler and BatchSpanProcessor): "
                     f"{floor.span_us:.1f} us per span + {floor.attribute_us:.2f} us per attribute; {traced.variant} "
                     f"records {traced.spans_per_request:.2f} spans and {traced.attributes_per_request:.1f} "
                     f"attributes per request -> {at:.1f} us = {at / off * 100:.1f}% of off before any of "
                     f"tiergate's own tracing code or cache misses (measured added: {traced.added_us:+.1f} us)")
    return lines


def main() -> None:
    """``python -m gateway.bench.obs_cost UPSTREAM [REQUESTS] [ROUNDS]`` (for profiling)."""
    import sys

    upstream = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    print("\n".join(report(measure(upstream, n, rounds), n, rounds, sdk_floor())))


if __name__ == "__main__":
    main()
