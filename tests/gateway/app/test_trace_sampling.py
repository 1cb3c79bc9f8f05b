"""The sampling decision tiergate takes ahead of the OpenTelemetry SDK (gateway.telemetry.trace_sampling):
the same decisions and trace flags as the SDK's parent-based sampler, ratio proportions, the cases
left to the SDK; through the app: a request sampled out records nothing and starts no SDK span yet
sends the upstream the trace id it drew, a client's unsampled traceparent is continued, a root
sampled in keeps the trace id drawn for it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import propagate
from opentelemetry.sdk.trace import Tracer, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind

from gateway.settings import TracingSettings
from gateway.telemetry import trace_sampling, tracing
from tests.gateway.app.observe_support import app_with
from tests.gateway.scripted_upstream import ScriptedUpstream

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
BODY = {"model": "auto", "reasoning_effort": "high", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}


def _provider(ratio: float) -> tuple[TracerProvider, InMemorySpanExporter]:
    provider = tracing.build_provider(TracingSettings(enabled=True, exporter="none", sample_ratio=ratio))
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.fixture
def sdk_spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the spans the SDK's tracers are asked to start."""
    started: list[str] = []
    original = Tracer.start_span

    def counting(self: Tracer, name: str, *args: Any, **kwargs: Any) -> Any:
        started.append(name)
        return original(self, name, *args, **kwargs)
    monkeypatch.setattr(Tracer, "start_span", counting)
    yield started


def _seed_for(sampled: bool, ratio: float) -> int:
    """A seed whose first 128-bit draw is sampled in (or out) at ``ratio``."""
    bound = TraceIdRatioBased(ratio).bound
    return next(seed for seed in range(1000)
                if (random.Random(seed).getrandbits(128) & trace_sampling.TRACE_ID_LIMIT < bound) == sampled)


def test_plan_follows_the_providers_sampler() -> None:
    built = _provider(0.1)[0]
    assert trace_sampling.plan(built) == trace_sampling.Plan(TraceIdRatioBased(0.1).bound, True, True)
    assert trace_sampling.plan(_provider(0.0)[0]) == trace_sampling.Plan(0, True, True)
    # every root sampled: decided here only for tiergate's own recording
    assert trace_sampling.plan(_provider(1.0)[0]) == trace_sampling.Plan(trace_sampling.ALL_ROOTS, True, True)
    # ratio roots of the SDK's own random ids: a sampled-in root could not keep the drawn id in the SDK,
    # so only tiergate's own recording decides them
    ratio = trace_sampling.plan(TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.1))))
    assert ratio == trace_sampling.Plan(TraceIdRatioBased(0.1).bound, False, True)
    assert trace_sampling.decide(ratio, None) is None and trace_sampling.decide(ratio, None, own=True) is not None
    assert trace_sampling.plan(TracerProvider(sampler=ParentBased(ALWAYS_OFF))) == trace_sampling.Plan(0, False, True)

    class Sequential(RandomIdGenerator):  # not the SDK's random ids: nothing recorded by tiergate itself
        pass

    other = trace_sampling.plan(TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.1)), id_generator=Sequential()))
    assert other == trace_sampling.Plan(None, False, False)
    assert trace_sampling.plan(TracerProvider(sampler=TraceIdRatioBased(0.1))) is None  # not parent-based
    assert trace_sampling.plan(TracerProvider(sampler=ParentBased(ALWAYS_ON, local_parent_not_sampled=ALWAYS_ON))) is None


def test_root_decisions_are_the_ratio_samplers_and_in_proportion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_sampling, "random", random.Random(20261201))
    sdk = TraceIdRatioBased(0.1)
    p = trace_sampling.Plan(sdk.bound, True)
    decisions = [trace_sampling.decide(p, None) for _ in range(20_000)]
    assert all(d is not None for d in decisions)
    sampled = [d for d in decisions if d is not None and d.sampled]
    assert 0.09 < len(sampled) / len(decisions) < 0.11
    assert all(d.sampled == sdk.should_sample(None, d.trace_id, "x").decision.is_sampled()
               for d in decisions if d is not None)
    assert len({d.trace_id for d in decisions if d is not None}) == len(decisions)
    assert not any(d.sampled for d in (trace_sampling.decide(trace_sampling.Plan(0, False), None) for _ in range(100))
                   if d is not None)


@pytest.mark.parametrize("traceparent", [f"00-{TRACE_ID}-{PARENT_ID}-00", f"00-{TRACE_ID}-{PARENT_ID}-02", None])
def test_an_unsampled_span_has_the_sdks_trace_flags(traceparent: str | None) -> None:
    """The span the SDK would start (ParentBased(ALWAYS_OFF), random ids) has the trace id and
    flags of the decision taken here."""
    carrier = {"traceparent": traceparent} if traceparent else None
    decision = trace_sampling.decide(trace_sampling.Plan(0, False), carrier)
    assert decision is not None and not decision.sampled
    parent = propagate.extract(carrier) if carrier else None
    span = TracerProvider(sampler=ParentBased(ALWAYS_OFF)).get_tracer("t").start_span("s", context=parent)
    ctx = span.get_span_context()
    assert not span.is_recording() and int(ctx.trace_flags) == decision.flags
    if traceparent:
        assert decision.trace_id == ctx.trace_id == int(TRACE_ID, 16) and decision.span_id != int(PARENT_ID, 16)
    assert decision.traceparent == f"00-{decision.trace_id:032x}-{decision.span_id:016x}-{decision.flags:02x}"


@pytest.mark.parametrize("carrier", [
    {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},  # sampled: the SDK records it
    {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00", "tracestate": "v=1"},
    {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00", "baggage": "k=v"},
    {"traceparent": f"01-{TRACE_ID}-{PARENT_ID}-00"},  # another version
    {"traceparent": f"00-{'0' * 32}-{PARENT_ID}-00"},  # invalid: the SDK starts a new trace
    {"traceparent": f"00-{TRACE_ID.upper()}-{PARENT_ID}-00"},
    {"traceparent": f" 00-{TRACE_ID}-{PARENT_ID}-00"},
])
def test_what_the_sdk_decides(carrier: dict[str, str]) -> None:
    assert trace_sampling.decide(trace_sampling.Plan(0, True), carrier) is None


async def test_a_sampled_out_request_records_nothing_and_sends_the_drawn_trace_id(
        tmp_path: Path, upstream: ScriptedUpstream, sdk_spans: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    provider, exporter = _provider(0.1)
    seed = _seed_for(False, 0.1)
    expected = random.Random(seed)
    trace_id, span_id = expected.getrandbits(128), expected.getrandbits(64)
    async with app_with(tmp_path, upstream, tracer_provider=provider,
                        observability={"tracing": {"enabled": True, "exporter": "none"}}) as gw:
        monkeypatch.setattr(trace_sampling, "random", random.Random(seed))
        before = len(upstream.requests)
        r = await gw.client.post("/v1/chat/completions", json=BODY, headers=gw.auth)
        assert r.status_code == 200, r.text
        sent = [req.headers["traceparent"] for req in upstream.requests[before:]]
    provider.shutdown()
    assert len(sent) > 1 and set(sent) == {f"00-{trace_id:032x}-{span_id:016x}-02"}  # every call: the same trace
    assert exporter.get_finished_spans() == () and sdk_spans == []  # nothing recorded, the SDK not even asked


async def test_a_root_sampled_in_keeps_the_drawn_trace_id(
        tmp_path: Path, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    provider, exporter = _provider(0.1)
    seed = _seed_for(True, 0.1)
    trace_id = random.Random(seed).getrandbits(128)
    async with app_with(tmp_path, upstream, tracer_provider=provider,
                        observability={"tracing": {"enabled": True, "exporter": "none"}}) as gw:
        monkeypatch.setattr(trace_sampling, "random", random.Random(seed))
        before = len(upstream.requests)
        r = await gw.client.post("/v1/chat/completions", json={**BODY, "model": "low"}, headers=gw.auth)
        assert r.status_code == 200, r.text
        (sent,) = [req.headers["traceparent"] for req in upstream.requests[before:]]
    jobs = [provider.get_tracer("job").start_span("job").get_span_context().trace_id for _ in range(2)]
    provider.shutdown()
    assert len({*jobs, trace_id}) == 3  # the preset id was the request's only: other roots draw their own
    spans = exporter.get_finished_spans()
    (server,) = [s for s in spans if s.kind == SpanKind.SERVER]
    (client,) = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert server.context.trace_id == client.context.trace_id == trace_id and server.parent is None
    assert sent == f"00-{trace_id:032x}-{client.context.span_id:016x}-03"  # sampled (and random ids)


@pytest.mark.parametrize("flags", ["00", "02"])
async def test_a_clients_unsampled_traceparent_is_continued_without_the_sdk(
        tmp_path: Path, upstream: ScriptedUpstream, sdk_spans: list[str], flags: str) -> None:
    provider, exporter = _provider(1.0)  # every new trace recorded; the client's choice is kept
    async with app_with(tmp_path, upstream, tracer_provider=provider,
                        observability={"tracing": {"enabled": True, "exporter": "none", "sample_ratio": 1.0}}) as gw:
        before = len(upstream.requests)
        r = await gw.client.post("/v1/chat/completions", json=BODY,
                                 headers={**gw.auth, "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-{flags}"})
        assert r.status_code == 200, r.text
        sent = {req.headers["traceparent"] for req in upstream.requests[before:]}
        assert exporter.get_finished_spans() == () and sdk_spans == []
        (one,) = sent
        version, trace_id, span_id, sent_flags = one.split("-")
        assert (version, trace_id, sent_flags) == ("00", TRACE_ID, flags) and span_id != PARENT_ID
        r = await gw.client.post("/v1/chat/completions", json=BODY, headers=gw.auth)  # no traceparent: recorded
        assert r.status_code == 200, r.text
    provider.shutdown()
    # the sampled request is recorded by tiergate itself (the SDK's batch/simple processors): no SDK span
    assert sdk_spans == [] and len(exporter.get_finished_spans()) > 2
