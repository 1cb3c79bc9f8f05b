"""OTLP trace export encoded straight to protobuf's wire format (``encode_spans``), and the OTLP/HTTP
exporter that sends it (``WireSpanExporter``).

The OpenTelemetry exporter builds one protobuf message object per span, attribute, value and
event and serializes the tree (``opentelemetry.exporter.otlp.proto.common``'s ``encode_spans``):
in a gateway that is ~100+ µs of CPU per span in the exporter's thread, taken from the event loop
through the GIL (`tiergate bench gateway`'s traced targets; py-spy showed the export thread at
~3.5% of the loop's time at ``sample_ratio`` 0.1). Here the same ``ExportTraceServiceRequest`` is
written as bytes directly: the resource and instrumentation scope once per batch (cached by
identity), attribute keys once per key, then per span its ids, times, name, kind, attributes,
events, links, status and flags. The result parses to a message equal to the exporter's own
(tests/gateway/app/test_otlp_wire.py compares them field by field for every value type).

``WireSpanExporter`` is the SDK's ``OTLPSpanExporter`` (endpoint, headers, timeout, compression,
retries) with the encoding replaced and its HTTP transport the SDK's urllib3 one (half the CPU a
batch of the default ``requests`` transport).

Imports opentelemetry only.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.environment_variables import (
    _OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER,
    OTEL_EXPORTER_OTLP_CERTIFICATE,
    OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE,
    OTEL_EXPORTER_OTLP_CLIENT_KEY,
    OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE,
    OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE,
    OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import SpanKind

_KIND = {SpanKind.INTERNAL: 1, SpanKind.SERVER: 2, SpanKind.CLIENT: 3, SpanKind.PRODUCER: 4, SpanKind.CONSUMER: 5}
HAS_IS_REMOTE, IS_REMOTE = 0x100, 0x200  # SpanFlags: the parent's remoteness is known / is remote
_D = struct.Struct("<d")
_Q = struct.Struct("<Q")
_I = struct.Struct("<I")


_SMALL = tuple(bytes((i,)) for i in range(128))


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _SMALL[n]
    if n < 0:
        n += 1 << 64  # int64: two's complement, ten bytes
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (``tag``: its number << 3 | 2, below 128)."""
    n = len(payload)
    return _SMALL[tag] + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


def _value(v: Any) -> bytes:
    """An ``AnyValue`` (its one field set, as the exporter's ``_encode_value`` sets it)."""
    if v is None:
        return b""
    if isinstance(v, bool):
        return b"\x10" + (b"\x01" if v else b"\x00")
    if isinstance(v, str):
        return _field(0x0A, v.encode())
    if isinstance(v, int):
        return b"\x18" + _varint(v)
    if isinstance(v, float):
        return b"\x21" + _D.pack(v)
    if isinstance(v, bytes):
        return _field(0x3A, v)
    if isinstance(v, Sequence):
        return _field(0x2A, b"".join(_field(0x0A, _value(x)) for x in v))
    if isinstance(v, Mapping):
        return _field(0x32, b"".join(_field(0x0A, _key_value(str(k), x)) for k, x in v.items()))
    raise TypeError(f"invalid attribute value type {type(v).__name__}")


def _key_value(key: str, v: Any) -> bytes:
    return _field(0x0A, key.encode()) + _field(0x12, _value(v))


# A KeyValue's length and bytes by (key, value, type): most of a request's attributes repeat from
# request to request (method, route, status, model, tier...). Strings, ints and bools only (a type
# in the key: True and 1 are equal as dict keys, their encodings are not); bounded.
_kv_cache: dict[tuple[str, Any, type], bytes] = {}
_KV_CACHE_MAX = 8192


def _attributes(tag: int, attributes: Mapping[str, Any] | None) -> bytes:
    if not attributes:
        return b""
    t_byte, out = _SMALL[tag], []
    cache = _kv_cache
    for k, v in attributes.items():
        t = type(v)
        if t is str or t is int or t is bool:
            ck = (k, v, t)
            lv = cache.get(ck)
            if lv is None:
                kv = _key_value(k, v)
                lv = _varint(len(kv)) + kv
                if len(cache) < _KV_CACHE_MAX:
                    cache[ck] = lv
        else:
            kv = _key_value(k, v)
            lv = _varint(len(kv)) + kv
        out.append(t_byte)
        out.append(lv)
    return b"".join(out)


def _flags(parent: Any) -> bytes:
    return _I.pack(HAS_IS_REMOTE | IS_REMOTE if parent is not None and parent.is_remote else HAS_IS_REMOTE)


def _span(s: ReadableSpan) -> bytes:
    ctx = s.context
    assert ctx is not None
    out = [b"\x0a\x10", ctx.trace_id.to_bytes(16, "big"), b"\x12\x08", ctx.span_id.to_bytes(8, "big")]
    if ctx.trace_state:
        out.append(_field(0x1A, ",".join(f"{k}={v}" for k, v in ctx.trace_state.items()).encode()))
    if s.parent is not None:
        out += (b"\x22\x08", s.parent.span_id.to_bytes(8, "big"))
    out.append(_field(0x2A, s.name.encode()))
    out += (b"\x30", _varint(_KIND[s.kind]), b"\x39", _Q.pack(s.start_time or 0), b"\x41", _Q.pack(s.end_time or 0))
    out.append(_attributes(0x4A, s.attributes))
    if s.dropped_attributes:
        out += (b"\x50", _varint(s.dropped_attributes))
    for e in s.events:
        event = [b"\x09", _Q.pack(e.timestamp or 0), _field(0x12, e.name.encode()), _attributes(0x1A, e.attributes)]
        if e.dropped_attributes:
            event += (b"\x20", _varint(e.dropped_attributes))
        out.append(_field(0x5A, b"".join(event)))
    if s.dropped_events:
        out += (b"\x60", _varint(s.dropped_events))
    for link in s.links:
        lc = link.context
        body = [b"\x0a\x10", lc.trace_id.to_bytes(16, "big"), b"\x12\x08", lc.span_id.to_bytes(8, "big"),
                _attributes(0x22, link.attributes)]
        if link.dropped_attributes:
            body += (b"\x28", _varint(link.dropped_attributes))
        body += (b"\x35", _flags(lc))
        out.append(_field(0x6A, b"".join(body)))
    if s.dropped_links:
        out += (b"\x70", _varint(s.dropped_links))
    status = s.status
    code = status.status_code.value
    status_body = (_field(0x12, status.description.encode()) if status.description else b"") + (
        b"\x18" + _varint(code) if code else b"")
    out += (_field(0x7A, status_body), b"\x85\x01", _flags(s.parent))
    return b"".join(out)


_resources: dict[int, tuple[Any, bytes]] = {}  # id(resource) -> (resource, its encoded Resource)
_scopes: dict[int, tuple[Any, bytes]] = {}


def _cached(cache: dict[int, tuple[Any, bytes]], obj: Any, encode: Any) -> bytes:
    hit = cache.get(id(obj))
    if hit is not None and hit[0] is obj:
        return hit[1]
    if len(cache) > 64:
        cache.clear()
    encoded: bytes = encode(obj)
    cache[id(obj)] = (obj, encoded)
    return encoded


def _resource(r: Any) -> bytes:
    return _attributes(0x0A, r.attributes)


def _scope(scope: Any) -> bytes:
    if scope is None:
        return b""
    out = _field(0x0A, scope.name.encode()) if scope.name else b""
    if scope.version:
        out += _field(0x12, scope.version.encode())
    return out + _attributes(0x1A, scope.attributes)


def encode_spans(spans: Sequence[ReadableSpan]) -> bytes:
    """The serialized ``ExportTraceServiceRequest`` for ``spans``: grouped by resource, then by
    instrumentation scope, in first-seen order, as the exporter's ``encode_spans`` groups them."""
    # A Resource's hash serializes its attributes to JSON on every call (hashed per span, ~a quarter of
    # the export thread's time), so the usual batch (every span from one provider's resource and one
    # tracer's scope, the same objects) is recognised by identity; anything else is grouped by
    # equality span by span, as the exporter groups it (the same groups, the same order).
    first = spans[0] if spans else None
    if first is not None and all(s.resource is first.resource and s.instrumentation_scope is first.instrumentation_scope
                                 for s in spans):
        grouped: dict[Any, dict[Any, list[bytes]]] = {first.resource: {first.instrumentation_scope or None:
                                                                        [_span(s) for s in spans]}}
    else:
        grouped = {}
        for s in spans:
            grouped.setdefault(s.resource, {}).setdefault(s.instrumentation_scope or None, []).append(_span(s))
    out = []
    for resource, scopes in grouped.items():
        body = [_field(0x0A, _cached(_resources, resource, _resource))]
        for scope, encoded in scopes.items():
            parts = [_field(0x0A, _cached(_scopes, scope, _scope)), *(_field(0x12, e) for e in encoded)]
            if scope is not None and scope.schema_url:
                parts.append(_field(0x1A, scope.schema_url.encode()))
            body.append(_field(0x12, b"".join(parts)))
        if resource.schema_url:
            body.append(_field(0x1A, resource.schema_url.encode()))
        out.append(_field(0x0A, b"".join(body)))
    return b"".join(out)


def _urllib3_transport(certificate_file: str | None, client_key_file: str | None,
                       client_certificate_file: str | None) -> Urllib3HTTPTransport:
    """The SDK's urllib3 transport, with the TLS settings its default (requests) transport would
    take: the arguments, else the ``OTEL_EXPORTER_OTLP_TRACES_*`` variables, else the
    ``OTEL_EXPORTER_OTLP_*`` ones (opentelemetry.exporter.otlp.proto.http._common._build_transport)."""
    def setting(given: str | None, traces_var: str, common_var: str) -> str | None:
        return given or os.environ.get(traces_var) or os.environ.get(common_var) or None

    verify = setting(certificate_file, OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE, OTEL_EXPORTER_OTLP_CERTIFICATE)
    key = setting(client_key_file, OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY, OTEL_EXPORTER_OTLP_CLIENT_KEY)
    cert = setting(client_certificate_file, OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE,
                   OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE)
    return Urllib3HTTPTransport(verify=verify or True, cert=(cert, key) if cert and key else cert)


class WireSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP span exporter (configuration, retries, compression, headers, timeout)
    sending batches encoded by ``encode_spans`` through the SDK's urllib3 transport instead of its
    default ``requests`` one: ~0.6 ms of CPU a batch instead of ~1.2 ms on the development
    machine (``requests`` adds its session, hooks and adapters over the same urllib3 pool), CPU
    taken from the event loop through the GIL. Given a ``requests`` ``session`` (e.g. one with an
    auth hook), or one named by the SDK's credential-provider variable, that session is used, as
    in the SDK."""

    def __init__(self, endpoint: str | None = None, certificate_file: str | None = None,
                 client_key_file: str | None = None, client_certificate_file: str | None = None,
                 session: Any = None, **kwargs: Any) -> None:
        if (session is None and "_transport" not in kwargs
                and not os.environ.get(_OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER)):
            kwargs["_transport"] = _urllib3_transport(certificate_file, client_key_file, client_certificate_file)
        super().__init__(endpoint, certificate_file, client_key_file, client_certificate_file, session=session,
                         **kwargs)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            return SpanExportResult.FAILURE
        result = self._client.export(encode_spans(spans))
        return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE
