"""gateway.telemetry.otlp_wire: the hand-written OTLP encoding parses to the message the OpenTelemetry
exporter's own encoder builds, for every attribute value type, events, links, statuses, trace
state, local and remote parents, several resources and scopes; and the wire exporter delivers
batches a collector's parser reads."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from gateway.telemetry import otlp_wire

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736


def _ctx(span_id: int, remote: bool = False, state: TraceState | None = None) -> SpanContext:
    return SpanContext(TRACE, span_id, remote, TraceFlags(3), state)


ATTRS: dict[str, Any] = {
    "s": "text", "empty": "", "unicode": "héllo ✓", "t": True, "f": False, "i": 42, "zero": 0, "neg": -7,
    "big": 2**62, "min": -(2**63), "d": 3.25, "nd": -0.0, "b": b"\x00\x01", "strs": ("a", "b"),
    "ints": (1, -2, 3), "floats": (0.5,), "bools": (True, False), "none_ok": None,
}


def _spans() -> list[ReadableSpan]:
    r1 = Resource.create({"service.name": "tiergate", "n": 3})
    r2 = Resource({"service.name": "other"}, schema_url="https://opentelemetry.io/schemas/1.21.0")
    sc1, sc2 = InstrumentationScope("tiergate"), InstrumentationScope("lib", "1.2", "https://x/schema")
    return [
        ReadableSpan("GET /v1/chat/completions", _ctx(1), None, r1, ATTRS, kind=SpanKind.SERVER,
                     start_time=1_700_000_000_000_000_000, end_time=1_700_000_000_123_456_789,
                     instrumentation_scope=sc1, status=Status(StatusCode.UNSET)),
        ReadableSpan("chat upstream", _ctx(2, state=TraceState([("vendor", "v1"), ("b", "2")])), _ctx(1),
                     r1, {"gen_ai.usage.input_tokens": 11}, kind=SpanKind.CLIENT, start_time=5, end_time=9,
                     instrumentation_scope=sc1, status=Status(StatusCode.ERROR, "UpstreamError: boom"),
                     events=[Event("exception", {"exception.type": "ValueError", "exception.escaped": "False"},
                                   timestamp=7)]),
        ReadableSpan("continued", _ctx(3), _ctx(0x00F067AA0BA902B7, remote=True), r1, {}, kind=SpanKind.INTERNAL,
                     start_time=1, end_time=2, instrumentation_scope=sc2, status=Status(StatusCode.OK),
                     links=[Link(_ctx(9, remote=True), {"why": "batch"})]),
        ReadableSpan("elsewhere", _ctx(4), None, r2, None, kind=SpanKind.PRODUCER, start_time=3, end_time=4,
                     instrumentation_scope=None),
        ReadableSpan("consumer", _ctx(5), _ctx(4), r2, {"k": "v"}, kind=SpanKind.CONSUMER, start_time=3, end_time=4,
                     instrumentation_scope=sc2),
    ]


def test_encoding_parses_to_the_exporters_own_message() -> None:
    spans = _spans()
    want = sdk_encode(spans)
    got = ExportTraceServiceRequest()
    got.ParseFromString(otlp_wire.encode_spans(spans))
    assert got == want, f"{got}\n!=\n{want}"
    assert otlp_wire.encode_spans(spans) == otlp_wire.encode_spans(spans)  # the caches give the same bytes
    for one in spans:  # each alone too (a resource or scope seen first)
        got = ExportTraceServiceRequest()
        got.ParseFromString(otlp_wire.encode_spans([one]))
        assert got == sdk_encode([one])
    # one resource and scope object for the whole batch (a server's usual batch: grouped by identity)
    got = ExportTraceServiceRequest()
    got.ParseFromString(otlp_wire.encode_spans(spans[:2]))
    assert got == sdk_encode(spans[:2]) and len(got.resource_spans) == 1


def test_resources_equal_by_value_are_one_group_as_the_exporter_makes_them() -> None:
    a, b = Resource.create({"service.name": "tiergate"}), Resource.create({"service.name": "tiergate"})
    scope = InstrumentationScope("tiergate")
    assert a is not b and a == b
    spans = [ReadableSpan(f"s{i}", _ctx(i + 1), None, r, {"i": i}, start_time=1, end_time=2, instrumentation_scope=scope)
             for i, r in enumerate((a, b, a))]
    got = ExportTraceServiceRequest()
    got.ParseFromString(otlp_wire.encode_spans(spans))
    assert got == sdk_encode(spans)
    assert len(got.resource_spans) == 1 and [s.name for s in got.resource_spans[0].scope_spans[0].spans] == [
        "s0", "s1", "s2"]


def test_a_value_the_exporter_cannot_encode_is_refused() -> None:
    span = ReadableSpan("x", _ctx(1), None, Resource.create({}), {"bad": object()}, start_time=1, end_time=2)
    with pytest.raises(TypeError):
        otlp_wire.encode_spans([span])


def test_the_wire_exporter_delivers_batches_a_collector_parses() -> None:
    """tracing.build_provider's OTLP exporter (the SDK's HTTP client, this encoding) against a
    local receiver that parses what arrives as a collector does."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from gateway.settings import TracingSettings
    from gateway.telemetry import tracing

    got: list[ExportTraceServiceRequest] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            assert self.path == "/v1/traces" and self.headers["content-type"] == "application/x-protobuf"
            msg = ExportTraceServiceRequest()
            msg.ParseFromString(body)
            got.append(msg)
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return None

    server = HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        provider = tracing.build_provider(TracingSettings(
            enabled=True, exporter="otlp", endpoint=f"http://127.0.0.1:{server.server_port}", sample_ratio=1.0))
        tracer = provider.get_tracer("t")
        for i in range(5):
            tracer.start_span(f"s{i}", attributes={"i": i, "tiergate.tier": "low"}).end()
        assert provider.force_flush(10_000)
        provider.shutdown()
    finally:
        server.shutdown()
        server.server_close()
    spans = [s for m in got for rs in m.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert sorted(s.name for s in spans) == [f"s{i}" for i in range(5)]
    assert {kv.value.int_value for s in spans for kv in s.attributes if kv.key == "i"} == set(range(5))
    (resource,) = {kv.value.string_value for m in got for rs in m.resource_spans for kv in rs.resource.attributes
                   if kv.key == "service.name"}
    assert resource == "tiergate"


def test_the_wire_exporter_sends_through_the_sdks_urllib3_transport_with_its_tls_settings(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The transport is the SDK's urllib3 one (not ``requests``: ~half the CPU a batch), and it takes
    the TLS settings the SDK's own transport would: the arguments first, then the traces variables,
    then the common ones. A ``requests`` session given by the caller is still used."""
    import requests
    from opentelemetry.exporter.http.transport._requests import RequestsHTTPTransport
    from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport

    from gateway.telemetry.otlp_wire import WireSpanExporter

    for var in ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "OTEL_EXPORTER_OTLP_CERTIFICATE",
                "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "OTEL_EXPORTER_OTLP_CLIENT_KEY",
                "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"):
        monkeypatch.delenv(var, raising=False)

    def pool_kw(exporter: WireSpanExporter) -> dict[str, Any]:
        transport = exporter._client._transport
        assert type(transport) is Urllib3HTTPTransport
        return dict(transport._pool.connection_pool_kw)

    plain = pool_kw(WireSpanExporter(endpoint="https://collector:4318/v1/traces"))
    assert plain["cert_reqs"] == "CERT_REQUIRED" and "ca_certs" not in plain and "cert_file" not in plain
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(tmp_path / "common-ca.pem"))
    assert pool_kw(WireSpanExporter())["ca_certs"] == str(tmp_path / "common-ca.pem")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(tmp_path / "traces-ca.pem"))
    assert pool_kw(WireSpanExporter())["ca_certs"] == str(tmp_path / "traces-ca.pem")
    assert pool_kw(WireSpanExporter(certificate_file="arg-ca.pem"))["ca_certs"] == "arg-ca.pem"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "client.pem")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "client.key")
    mtls = pool_kw(WireSpanExporter())
    assert (mtls["cert_file"], mtls["key_file"]) == ("client.pem", "client.key")
    session = requests.Session()
    given = WireSpanExporter(session=session)._client._transport
    assert type(given) is RequestsHTTPTransport and given._session is session
    monkeypatch.setenv("OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER", "no-such-provider")
    with pytest.raises(RuntimeError):  # left to the SDK, which loads the named session (here: none such)
        WireSpanExporter()
