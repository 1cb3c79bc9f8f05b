"""OpenTelemetry traces through the real app, collected by an in-memory span exporter: the span
tree of a direct and of a pipelined request with the GenAI attributes, a client's traceparent
continued and the trace propagated upstream, no prompt text unless asked for, nothing when off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import SpanKind

from tests.gateway.app.observe_support import app_with
from tests.gateway.scripted_upstream import ScriptedUpstream

MSGS = [{"role": "user", "content": "a secret prompt"}]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
ON = {"observability": {"tracing": {"enabled": True, "exporter": "none"}}}


@pytest.fixture
def exported() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def _server(spans: list[ReadableSpan]) -> ReadableSpan:
    (server,) = [s for s in spans if s.kind == SpanKind.SERVER]
    return server


async def test_direct_request_continues_the_clients_trace(tmp_path: Path, upstream: ScriptedUpstream,
                                                          exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = exported
    async with app_with(tmp_path, upstream, tracer_provider=provider, **ON) as gw:
        r = await gw.client.post("/v1/chat/completions", json={"model": "tier-low", "messages": MSGS, "max_tokens": 3},
                                 headers={**gw.auth, "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        assert r.status_code == 200, r.text
        (row,) = gw.ledger_rows()
    spans = list(exporter.get_finished_spans())
    server = _server(spans)
    assert format(server.context.trace_id, "032x") == TRACE_ID and server.parent is not None
    assert format(server.parent.span_id, "016x") == PARENT_ID  # the client's span is the parent
    a = dict(server.attributes or {})
    assert a["http.route"] == "/v1/chat/completions" and a["http.response.status_code"] == 200
    assert (a["tiergate.tier"], a["tiergate.effort"], a["gen_ai.request.model"]) == ("low", "low", "tier-low")
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (row.prompt_tokens, row.completion_tokens)
    assert a["tiergate.cost_usd"] == pytest.approx(float(row.cost_usd)) and a["tiergate.request_id"] == r.json()["id"]
    (client,) = _children(spans, server)
    c = dict(client.attributes or {})
    assert client.kind == SpanKind.CLIENT and client.name == "chat upstream-a"
    assert (c["gen_ai.system"], c["gen_ai.request.model"], c["gen_ai.operation.name"]) == ("openai", "upstream-a", "chat")
    assert (c["gen_ai.usage.input_tokens"], c["gen_ai.usage.output_tokens"]) == (11, 3)
    # the upstream continues the trace under the client span
    sent = upstream.requests[-1].headers["traceparent"]
    assert sent.split("-")[1] == TRACE_ID and sent.split("-")[2] == format(client.context.span_id, "016x")
    assert "secret prompt" not in repr([s.attributes for s in spans])  # no content without the switch


async def test_pipeline_request_has_a_span_per_stage(tmp_path: Path, upstream: ScriptedUpstream,
                                                     exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = exported
    async with app_with(tmp_path, upstream, tracer_provider=provider, **ON) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
            "model": "auto", "reasoning_effort": "high", "messages": MSGS, "max_tokens": 200, "stream": True})
        assert r.status_code == 200, r.text
        rows = gw.ledger_rows()
    spans = list(exporter.get_finished_spans())
    server = _server(spans)
    assert dict(server.attributes or {})["tiergate.pipeline"] is True
    stages = _children(spans, server)
    assert stages and all(s.name.startswith("tiergate.stage ") for s in stages)
    names = {dict(s.attributes or {})["tiergate.stage"] for s in stages}
    # the scripted upstream writes no valid plan: plan (and its repair), then the direct answer, streamed
    assert "plan" in names and "direct" in names, names
    clients = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert len(clients) == len(rows) > 1  # one client span per upstream call, each under its stage
    stage_ids = {s.context.span_id for s in stages}
    assert all(c.parent is not None and c.parent.span_id in stage_ids for c in clients)
    assert sum(dict(c.attributes or {})["gen_ai.usage.output_tokens"] for c in clients) == sum(
        row.completion_tokens for row in rows) == dict(server.attributes or {})["gen_ai.usage.output_tokens"]
    assert len({s.context.trace_id for s in spans}) == 1


async def test_content_only_with_the_switch_and_nothing_when_off(
        tmp_path: Path, upstream: ScriptedUpstream, exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = exported
    body: dict[str, Any] = {"model": "low", "messages": MSGS, "max_tokens": 2}
    on = {"observability": {"tracing": {"enabled": True, "exporter": "none", "capture_content": True}}}
    async with app_with(tmp_path / "a", upstream, tracer_provider=provider, **on) as gw:
        assert (await gw.client.post("/v1/chat/completions", headers=gw.auth, json=body)).status_code == 200
    a = dict(_server(list(exporter.get_finished_spans())).attributes or {})
    assert "a secret prompt" in str(a["gen_ai.input.messages"]) and "w0 w1" in str(a["gen_ai.output.messages"])
    exporter.clear()
    async with app_with(tmp_path / "b", upstream, tracer_provider=provider) as gw:  # tracing off (the default)
        assert (await gw.client.post("/v1/chat/completions", headers=gw.auth, json=body)).status_code == 200
    assert exporter.get_finished_spans() == () and "traceparent" not in upstream.requests[-1].headers


class _CountingSampler(Sampler):
    """The SDK's default (parent-based, always on), counting the spans it is asked about."""

    def __init__(self) -> None:
        self.inner, self.calls = ParentBased(ALWAYS_ON), 0

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        self.calls += 1
        return self.inner.should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return "counting"


async def test_a_sampled_out_request_starts_no_child_span_but_propagates(tmp_path: Path,
                                                                          upstream: ScriptedUpstream) -> None:
    sampler, exporter = _CountingSampler(), InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    body = {"model": "auto", "reasoning_effort": "high", "messages": MSGS, "max_tokens": 200}
    async with app_with(tmp_path, upstream, tracer_provider=provider, **ON) as gw:
        r = await gw.client.post("/v1/chat/completions", json=body,
                                 headers={**gw.auth, "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"})  # not sampled
        assert r.status_code == 200, r.text
        rows = gw.ledger_rows()
        assert len(rows) > 1  # a pipelined request: stages and several upstream calls
        assert sampler.calls == 1 and exporter.get_finished_spans() == ()  # the server span's decision only
        for sent in (req.headers["traceparent"] for req in upstream.requests[-len(rows):]):
            assert sent.split("-")[1] == TRACE_ID and sent.endswith("-00")  # the trace continues, unsampled
        sampler.calls = 0  # the same app, a sampled request: every span asked about and recorded
        r = await gw.client.post("/v1/chat/completions", json=body, headers=gw.auth)
        assert r.status_code == 200, r.text
    assert sampler.calls == len(exporter.get_finished_spans()) > 2
    provider.shutdown()


def test_annotations_outside_a_request_span_go_to_the_current_span(
        exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    """Called where no request span of tiergate's is current (a job, a test), the annotate helpers
    put their attributes on whatever span is current, at once; with none recording, nowhere."""
    from types import SimpleNamespace

    from gateway.settings import TracingSettings
    from gateway.telemetry import tracing

    provider, exporter = exported
    tracing.configure(TracingSettings(enabled=True, exporter="none"), provider)
    record = SimpleNamespace(id="req-1", prompt_tokens=4, completion_tokens=2, cost_nanos=3_000_000_000,
                             status="error", error_code="upstream_timeout")
    try:
        tracing.annotate_outcome(record)  # no span current: nothing, no error
        with provider.get_tracer("t").start_as_current_span("job"):
            tracing.annotate_outcome(record)
    finally:
        tracing.configure(TracingSettings())
    (span,) = exporter.get_finished_spans()
    a = dict(span.attributes or {})
    assert (a["tiergate.request_id"], a["gen_ai.usage.output_tokens"], a["error.type"]) == ("req-1", 2, "upstream_timeout")
    assert a["tiergate.cost_usd"] == 3.0


async def test_an_unsampled_requests_upstream_calls_share_its_trace_context(tmp_path: Path,
                                                                            upstream: ScriptedUpstream) -> None:
    """The headers an unsampled request sends upstream (built once per request) are the same on
    every call of it; the next request gets its own trace, not the first one's headers."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    body = {"model": "auto", "reasoning_effort": "high", "messages": MSGS, "max_tokens": 200}
    async with app_with(tmp_path, upstream, tracer_provider=provider, **ON) as gw:
        sent: list[list[str]] = []
        for _ in range(2):
            before = len(upstream.requests)
            assert (await gw.client.post("/v1/chat/completions", json=body, headers=gw.auth)).status_code == 200
            sent.append([req.headers["traceparent"] for req in upstream.requests[before:]])
    provider.shutdown()
    first, second = sent
    assert len(first) > 1 and len(set(first)) == 1 and len(set(second)) == 1
    assert not int(first[0].split("-")[3], 16) & 1  # flagged unsampled
    assert first[0].split("-")[1] != second[0].split("-")[1]  # a new trace per request: headers not kept across


@pytest.mark.parametrize("case", ["sampled", "unsampled", "tracestate", "baggage", "not-w3c"])
def test_upstream_headers_are_what_the_propagators_write(case: str) -> None:
    """The headers written directly (default W3C propagators, no baggage) equal what
    ``propagate.inject`` writes, and the other cases go through the propagators."""
    from opentelemetry import baggage, propagate, trace
    from opentelemetry import context as otel_context
    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from gateway.telemetry import tracing

    flags = TraceFlags(0x02 if case == "unsampled" else 0x03)
    state = TraceState([("vendor", "v1")]) if case == "tracestate" else None
    span = NonRecordingSpan(SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, False, flags, state))
    ctx = baggage.set_baggage("tenant", "t1") if case == "baggage" else otel_context.get_current()
    before = propagate.get_global_textmap()
    if case == "not-w3c":
        propagate.set_global_textmap(CompositePropagator([TraceContextTextMapPropagator()]))
    try:
        expected: dict[str, str] = {}
        propagate.inject(expected, context=trace.set_span_in_context(span, ctx))
        got = tracing._trace_headers(span, ctx)
    finally:
        propagate.set_global_textmap(before)
    assert dict(got) == expected and [k for k, _ in got] == list(expected)
    assert expected["traceparent"] == f"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{int(flags):02x}"
    assert ("baggage" in expected) == (case == "baggage") and ("tracestate" in expected) == (case == "tracestate")


class _StartingProcessor(SimpleSpanProcessor):
    """A processor of another type than the SDK's batch/simple ones (it might use ``on_start``):
    with it on the provider every span goes through the SDK's ``Span``, as without tiergate's own
    recording."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        super().__init__(exporter)
        self.started = 0

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.started += 1


def _tree(spans: list[ReadableSpan]) -> list[tuple[Any, ...]]:
    """The spans without ids and times: name, kind, parent's name, status, attributes (the request
    id, which differs per request, dropped), exception events' types."""
    by_id = {s.context.span_id: s for s in spans}
    out = []
    for s in spans:
        up = by_id.get(s.parent.span_id) if s.parent is not None else None
        parent = up.name if up is not None else ("remote" if s.parent is not None else None)
        attrs = {k: v for k, v in (s.attributes or {}).items() if k not in ("tiergate.request_id", "gen_ai.response.id")}
        events = tuple(dict(e.attributes or {}).get("exception.type") for e in s.events)
        out.append((s.name, s.kind, parent, s.status.status_code, tuple(sorted(attrs.items(), key=str)), events))
    return sorted(out, key=repr)


@pytest.mark.slow
@pytest.mark.parametrize("sampled_parent", [False, True])
async def test_own_recording_gives_the_sdks_span_tree(tmp_path: Path, upstream: ScriptedUpstream,
                                                      sampled_parent: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled request recorded by tiergate itself (``OwnSpan``: no SDK ``Span``, the provider's
    batch/simple processors get the ended spans) gives the same spans as the SDK records: names,
    kinds, parents, statuses, attributes; for a direct, a pipelined streamed and a failed request,
    a new trace or a client's sampled one continued with the upstream told the client span's id."""
    from opentelemetry.sdk.trace import Tracer
    from opentelemetry.sdk.trace.sampling import ParentBased

    from tests.gateway.scripted_upstream import Behaviour

    sdk_started: list[str] = []
    original = Tracer.start_span

    def counting(self: Tracer, name: str, *args: Any, **kwargs: Any) -> Any:
        sdk_started.append(name)
        return original(self, name, *args, **kwargs)
    monkeypatch.setattr(Tracer, "start_span", counting)

    bodies: list[dict[str, Any]] = [
        {"model": "tier-low", "messages": MSGS, "max_tokens": 3},
        {"model": "auto", "reasoning_effort": "high", "messages": MSGS, "max_tokens": 200, "stream": True},
        {"model": "tier-low", "messages": MSGS, "max_tokens": 3},  # the upstream fails it
    ]
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"} if sampled_parent else {}
    trees, sent = [], []
    for own in (True, False):
        exporter, sdk_started[:] = InMemorySpanExporter(), []
        provider = TracerProvider(sampler=ParentBased(ALWAYS_ON))
        processor = SimpleSpanProcessor(exporter) if own else _StartingProcessor(exporter)
        provider.add_span_processor(processor)
        async with app_with(tmp_path / str(own), upstream, tracer_provider=provider, **ON) as gw:
            for i, body in enumerate(bodies):
                if i == 2:
                    upstream.push(*[Behaviour(status=500)] * 8)
                before = len(upstream.requests)
                r = await gw.client.post("/v1/chat/completions", json=body, headers={**gw.auth, **headers})
                assert (r.status_code == 200) == (i != 2), r.text
                sent.append([req.headers["traceparent"] for req in upstream.requests[before:]])
                upstream.clear()
        provider.shutdown()
        spans = list(exporter.get_finished_spans())
        # own: the SDK never asked to start a span; else every span through the SDK (and on_start)
        assert len(sdk_started) == (0 if own else len(spans))
        assert own or (isinstance(processor, _StartingProcessor) and processor.started == len(spans))
        clients = {s.context.span_id: s for s in spans if s.kind == SpanKind.CLIENT}
        for group in sent:  # each upstream call was told its own client span, in the request's trace
            for tp in group:
                _, trace_id, span_id, flags = tp.split("-")
                assert int(span_id, 16) in clients and flags == ("01" if sampled_parent else "03")  # SDK: random ids
                if sampled_parent:
                    assert trace_id == TRACE_ID
        sent.clear()
        servers = [s for s in spans if s.kind == SpanKind.SERVER]
        assert len(servers) == 3 and all((s.parent is not None) == sampled_parent for s in servers)
        if sampled_parent:
            assert all(s.parent is not None and format(s.parent.span_id, "016x") == PARENT_ID and s.parent.is_remote
                       for s in servers)
        trees.append(_tree(spans))
    assert trees[0] == trees[1] and len(trees[0]) > 6
