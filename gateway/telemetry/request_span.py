"""The tracer provider tiergate builds (``configure``) and each HTTP request's server span
(``server_span`` / ``end_server_span``, called by gateway.web.observe), with the request's tracing
state (``ServerSpan``) that gateway.telemetry.tracing's annotate, stage and attempt helpers read
from one context variable. See gateway.telemetry.tracing for the span tree and what each part
costs; everything here is importable from there.

Imports opentelemetry and settings only.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from gateway.settings import TracingSettings
from gateway.telemetry import trace_sampling
from gateway.telemetry.own_spans import OwnRecording, OwnSpan

_state: dict[str, Any] = {"tracer": None, "capture": False, "propagator": None, "fields": frozenset(), "w3c": False,
                          "plan": None, "own": None}
_W3C_FIELDS = frozenset({b"traceparent", b"tracestate", b"baggage"})  # the default propagators' (W3C)


def enabled() -> bool:
    return _state["tracer"] is not None


def build_provider(cfg: TracingSettings) -> TracerProvider:
    """A tracer provider for ``cfg``: sampled by ``sample_ratio`` (a sampled parent's choice is
    kept), exporting in batches over OTLP/HTTP, to the console, or nowhere (``none``: tests
    add their own processor)."""
    root: Sampler = (ALWAYS_ON if cfg.sample_ratio >= 1 else ALWAYS_OFF if cfg.sample_ratio <= 0
                     else TraceIdRatioBased(cfg.sample_ratio))
    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}),
                              sampler=ParentBased(root), id_generator=trace_sampling.PresetTraceIds())
    if cfg.exporter == "otlp":  # the SDK's OTLP/HTTP exporter, encoding by gateway.telemetry.otlp_wire
        from gateway.telemetry.otlp_wire import WireSpanExporter

        endpoint = cfg.endpoint.rstrip("/") + "/v1/traces" if cfg.endpoint else None
        provider.add_span_processor(BatchSpanProcessor(WireSpanExporter(endpoint=endpoint)))
    elif cfg.exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    return provider


def configure(cfg: TracingSettings, provider: TracerProvider | None = None) -> TracerProvider | None:
    """Turn tracing on (``cfg.enabled``; ``provider``: use this one, e.g. a test's) or off in
    this process. Returns the provider in use, or None when off."""
    if not cfg.enabled:
        _state["tracer"], _state["capture"], _state["plan"], _state["own"] = None, False, None, None
        return None
    provider = provider or build_provider(cfg)
    _state["tracer"] = tracer = provider.get_tracer("tiergate")
    _state["plan"] = plan = trace_sampling.plan(provider)  # what tiergate may decide ahead of the SDK
    _state["own"] = OwnRecording.of(provider, tracer) if plan is not None and plan.random_ids else None
    _state["capture"] = cfg.capture_content
    return provider


_current_own: ContextVar[OwnSpan | None] = ContextVar("tiergate_own_span", default=None)  # a stage's, while it runs


def _own_parent() -> OwnSpan | None:
    """The span tiergate records itself that a new span of the current request is a child of (the
    stage running, else the request's), or None when the request's spans are the SDK's."""
    s = _request.get()
    if s is None or s.own is None:
        return None
    return _current_own.get() or s.own


# -- the request span (the server span, current in the request's context) -----------------------
class ServerSpan:
    """One request's server span, the context tokens that made it current, and what is pending
    for it: the attributes set when it ends, the upstream headers of an unsampled request. A
    request decided not sampled ahead of the SDK (``decision``) has no span object unless one is
    asked for (``span``), no OpenTelemetry context (``token`` None) and its upstream headers
    written once (``upstream``). A sampled request tiergate records itself has its ``own`` span
    (an ``OwnSpan``, its children too) and no OpenTelemetry context either."""

    __slots__ = ("_span", "attributes", "decision", "headers", "own", "recording", "sampled", "scope", "token",
                 "upstream", "var_token")

    def __init__(self, span: trace.Span | None, token: Token[otel_context.Context] | None, scope: Any,
                 decision: trace_sampling.Decision | None = None, own: OwnSpan | None = None) -> None:
        self._span, self.token, self.scope, self.decision, self.own = span, token, scope, decision, own
        self.attributes: dict[str, Any] = {}
        self.headers: tuple[otel_context.Context, tuple[tuple[str, str], ...]] | None = None
        self.var_token: Token[ServerSpan | None] | None = None
        self.upstream: tuple[tuple[str, str], ...] | None = None
        if own is not None:
            self.recording = self.sampled = True
        elif span is not None:
            self.recording = span.is_recording()
            self.sampled = bool(span.get_span_context().trace_flags.sampled)
        else:  # (server_span builds this case itself, without this call: see there)
            assert decision is not None and not decision.sampled
            self.recording = self.sampled = False
            self.upstream = (("traceparent", decision.traceparent),)

    @property
    def span(self) -> Any:
        if self.own is not None:
            return self.own
        if self._span is None:  # decided here: the non-recording span the SDK would have made
            d = self.decision
            assert d is not None
            self._span = trace.NonRecordingSpan(trace.SpanContext(d.trace_id, d.span_id, False,
                                                                  trace.TraceFlags(d.flags)))
        return self._span


_request: ContextVar[ServerSpan | None] = ContextVar("tiergate_server_span", default=None)
_new_span = object.__new__
_NO_ATTRIBUTES: dict[str, Any] = {}  # an unsampled request's: never written (nothing is recorded)
# opentelemetry.propagate's global propagator, read as get_global_textmap() returns it (a dict
# lookup per request instead of a call); the function where that module does not keep it there.
_propagate_globals = vars(propagate)


def _context_getter() -> Any:
    """``opentelemetry.context.get_current`` as one call of its context variable's ``get`` where
    the runtime context is the SDK's default (contextvars), else the API function itself."""
    var = getattr(getattr(otel_context, "_RUNTIME_CONTEXT", None), "_current_context", None)
    return var.get if isinstance(var, ContextVar) else otel_context.get_current


_current_context = _context_getter()


def _header_fields(propagator: Any) -> frozenset[bytes]:
    """The header names ``propagator`` reads, as ASGI spells them (lower-case bytes), looked up
    once per propagator (a composite builds its set on every ``fields`` call); and whether they
    are W3C trace context and baggage's only (``_state["w3c"]``, see ``_trace_headers``)."""
    if _state["propagator"] is not propagator:
        _state["fields"] = frozenset(f.lower().encode("latin-1") for f in propagator.fields)
        _state["w3c"] = _state["fields"] == _W3C_FIELDS
        _state["propagator"] = propagator
    fields: frozenset[bytes] = _state["fields"]
    return fields


def server_span(scope: Any) -> ServerSpan | None:
    """Start the server span of an HTTP request (``scope``: its ASGI scope) and make it current,
    continuing the trace context the client's headers carry (the configured propagators' fields:
    ``traceparent``, ``tracestate``, ``baggage`` by default); None when tracing is off. A request
    that is not sampled gets a non-recording span: a sampling decision and nothing else."""
    tracer = _state["tracer"]
    if tracer is None:
        return None
    propagator = _propagate_globals.get("_HTTP_TEXT_FORMAT") or propagate.get_global_textmap()
    fields = _state["fields"] if propagator is _state["propagator"] else _header_fields(propagator)
    carrier: dict[str, str] | None = None
    for key, value in scope["headers"]:
        if key in fields:
            if carrier is None:
                carrier = {}
            carrier[key.decode("latin-1")] = value.decode("latin-1")
    plan, decision, own = _state["plan"], None, _state["own"]
    if (plan is not None and (carrier is not None or plan.bound is not None) and _state["w3c"]
            and not _current_context()):  # no ambient span or baggage
        if own is not None and own.multi._span_processors is not own.processors and not own.usable():
            own = None  # a processor added since that needs the SDK's spans
        decision = trace_sampling.decide(plan, carrier, own is not None)
        if decision is not None and not decision.sampled:  # no span, no context: a draw and a header
            # ServerSpan._unsampled(scope, decision), inline: every request not sampled comes here
            s = _new_span(ServerSpan)
            s._span = s.token = s.own = s.headers = None
            s.scope, s.decision, s.attributes, s.recording, s.sampled = scope, decision, _NO_ATTRIBUTES, False, False
            s.upstream = (("traceparent",
                           f"00-{decision.trace_id:032x}-{decision.span_id:016x}-{decision.flags:02x}"),)
            s.var_token = _request.set(s)
            return s
        if decision is not None and own is not None:  # sampled, recorded by tiergate: no SDK span, no context
            remote = (trace.SpanContext(decision.trace_id, decision.parent_id, True, trace.TraceFlags(decision.flags))
                      if decision.parent_id else None)  # the client's span (its flags: sampled, random kept)
            context = trace.SpanContext(decision.trace_id, decision.span_id, False, trace.TraceFlags(decision.flags))
            s = ServerSpan(None, None, scope, decision, OwnSpan(own, scope.get("method") or "HTTP", SpanKind.SERVER,
                                                                context, remote))
            s.var_token = _request.set(s)
            return s
    parent = propagator.extract(carrier) if carrier else None
    name = scope.get("method") or "HTTP"
    if decision is None:
        span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER)
    else:  # a root sampled in here: the SDK starts it with the trace id drawn (its sampler agrees)
        preset = trace_sampling.preset(decision.trace_id)
        try:
            span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER)
        finally:
            trace_sampling.clear(preset)
    s = ServerSpan(span, otel_context.attach(trace.set_span_in_context(span, parent)), scope)
    s.var_token = _request.set(s)
    return s


def end_server_span(s: ServerSpan, route: str | None, status: int, error: BaseException | None = None) -> None:
    """End the request's span: route template (None: no route matched), status, error; with
    the attributes the request collected on it (one ``set_attributes``)."""
    if s.token is not None:
        otel_context.detach(s.token)
    if s.var_token is not None:
        try:
            _request.reset(s.var_token)
        except ValueError:  # ended in another context than it started in (as detach, no error)
            _request.set(None)
    if not s.recording:
        return
    s.recording = False  # what the request annotates from here on is not kept (as for an ended span)
    span, scope, attributes = s.span, s.scope, s.attributes
    method = scope.get("method") or "HTTP"
    attributes["http.request.method"] = method
    attributes["url.scheme"] = scope.get("scheme", "http")
    attributes["url.path"] = scope.get("path", "")
    attributes["http.response.status_code"] = status
    if scope.get("http_version"):
        attributes["network.protocol.version"] = scope["http_version"]
    if route is not None:
        attributes["http.route"] = route
        span.update_name(f"{method} {route}")
    if status >= 500 or error is not None:
        attributes["error.type"] = type(error).__name__ if error is not None else str(status)
        span.set_status(StatusCode.ERROR)
    span.set_attributes(attributes)
    span.end()
