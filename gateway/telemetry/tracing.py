"""OpenTelemetry traces (``observability.tracing``, off by default).

The span tree of one request:

* the HTTP server span (``server_span``, started and ended by gateway.web.observe — FastAPI's
  own instrumentation stays off, so there is one server span, not two): it continues a W3C
  ``traceparent`` the client sent, and carries ``http.route``, the method, path and status;
  the chat flow adds the routing decision (``tiergate.tier``, ``tiergate.effort``,
  ``tiergate.effort_source``, ``gen_ai.request.model``) and, when the request ends, its usage
  and cost (``gen_ai.usage.input_tokens`` / ``output_tokens``, ``tiergate.cost_usd``);
* ``tiergate.stage <name>`` spans, one per pipeline stage call (plan, execute, review…);
* ``chat <upstream model>`` client spans, one per upstream attempt (retries and fallbacks
  each their own), with the GenAI semantic conventions (``gen_ai.operation.name``,
  ``gen_ai.system``, ``gen_ai.request.model``, ``gen_ai.usage.*``, ``error.type``); their
  context goes upstream as ``traceparent`` (OpenAI-compatible upstreams).

Prompt and completion text are never put on a span unless ``capture_content`` is set. With
tracing off every helper here is one check of a module global. Sampling is parent-based (the
client's sampled flag is kept; a new trace is sampled with ``sample_ratio``): in a request that
is not sampled no stage or client span is started at all (a sampled-out parent's children are
never sampled), only its trace context is passed upstream, so a sampled-out request costs the
server span's sampling decision and little else. Where the provider's sampler allows it
(gateway.telemetry.trace_sampling: parent-based, default delegates, roots by ratio) that decision
is taken ahead of the SDK: a request not sampled then costs a random draw and its ``traceparent``
string, with no span object and no OpenTelemetry context attached.

A sampled request whose decision was taken here is recorded by tiergate itself where the provider
allows it (``OwnRecording``, gateway.telemetry.own_spans: an SDK provider whose processors are all the SDK's batch or simple
ones — their ``on_start`` does nothing — with default span limits and random ids): its spans are
``OwnSpan`` objects — a name, ids, a plain attribute dict, a status — with no SDK ``Span``, no
OpenTelemetry context attached, no per-attribute validation or lock, and each, when it ends,
goes to the provider's processors as the ``ReadableSpan`` the SDK's ``Span.end`` would hand them
(same names, kinds, parents, attributes, statuses, exception events: tests/gateway/app/test_tracing.py
compares the two). The stage running is tracked in a context variable of this module's, the
upstream ``traceparent`` is written from the client span's ids. About 4 µs per span instead of
the SDK's ~10–28 µs (``python -m gateway.bench.obs_cost``'s SDK floor); with any other processor
(one that may use ``on_start``), limits or id generator, every span goes through the SDK as before.

Per-request work is kept to what the SDK needs: the request's attributes are collected in a plain
dict and handed to the server span once, when it ends (one validation pass, one lock); the
propagators' header names are looked up once per propagator, not per request; the request's
state (its span, whether it is recorded and sampled) is one context variable read by the
annotate/stage/attempt helpers instead of a walk of the OpenTelemetry context each; and an
unsampled request's upstream headers are built once and reused by every upstream call.

Imports opentelemetry and settings only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar, Token
from typing import Any

import orjson
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from gateway.settings import TracingSettings
from gateway.telemetry import trace_sampling
from gateway.telemetry.own_spans import OwnRecording, OwnSpan

NANOS_PER_USD = 1_000_000_000
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
        else:
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
    propagator = propagate.get_global_textmap()
    fields = _header_fields(propagator)
    carrier: dict[str, str] | None = None
    for key, value in scope["headers"]:
        if key in fields:
            if carrier is None:
                carrier = {}
            carrier[key.decode("latin-1")] = value.decode("latin-1")
    plan, decision, own = _state["plan"], None, _state["own"]
    if (plan is not None and (carrier is not None or plan.bound is not None) and _state["w3c"]
            and not otel_context.get_current()):  # no ambient span or baggage
        own = own if own is not None and own.usable() else None
        decision = trace_sampling.decide(plan, carrier, own is not None)
        if decision is not None and not decision.sampled:  # no span, no context: a draw and a header
            s = ServerSpan(None, None, scope, decision)
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


def _pending() -> dict[str, Any] | None:
    """Where the current request's span attributes go: the request's pending dict (set when its
    span ends), a dict to put on the current span right away (``_flush``) when no request span
    of this module's is current, or None when nothing is recorded."""
    s = _request.get()
    if s is not None:
        return s.attributes if s.recording else None
    return {} if trace.get_current_span().is_recording() else None


def _flush(attributes: dict[str, Any]) -> None:
    """Attributes collected outside a request span of this module's: onto the current span."""
    if _request.get() is None and attributes:
        trace.get_current_span().set_attributes(attributes)


def annotate_request(decision: Any, messages: list[dict[str, Any]] | None = None) -> None:
    """The routing decision on the current request span (``decision``: a RouteDecision)."""
    if _state["tracer"] is None or (attributes := _pending()) is None:
        return
    attributes["gen_ai.operation.name"] = "chat"
    attributes["gen_ai.request.model"] = decision.requested_model
    attributes["tiergate.tier"] = attributes["tiergate.effort"] = decision.tier
    attributes["tiergate.effort_source"] = decision.effort_source
    attributes["tiergate.pipeline"] = decision.uses_pipeline
    attributes["tiergate.model"] = decision.models[0]
    if _state["capture"] and messages is not None:
        attributes["gen_ai.input.messages"] = orjson.dumps(messages).decode()
    _flush(attributes)


def annotate_outcome(record: Any) -> None:
    """A finished request's usage, cost and status on the current request span (``record``: a
    RequestRecord)."""
    if _state["tracer"] is None or (attributes := _pending()) is None:
        return
    attributes["tiergate.request_id"] = attributes["gen_ai.response.id"] = record.id
    attributes["gen_ai.usage.input_tokens"] = record.prompt_tokens
    attributes["gen_ai.usage.output_tokens"] = record.completion_tokens
    attributes["tiergate.cost_usd"] = record.cost_nanos / NANOS_PER_USD
    attributes["tiergate.status"] = record.status
    if record.error_code:
        attributes["error.type"] = record.error_code
    _flush(attributes)


def annotate_completion(response: dict[str, Any]) -> None:
    """The answer's messages on the current request span — only with ``capture_content``."""
    if _state["tracer"] is None or not _state["capture"] or (attributes := _pending()) is None:
        return
    attributes["gen_ai.output.messages"] = orjson.dumps(
        [c.get("message") for c in response.get("choices") or ()]).decode()
    _flush(attributes)


# -- pipeline stages ------------------------------------------------------------------------------
@contextmanager
def _stage(name: str, tier: str, attributes: dict[str, Any]) -> Iterator[trace.Span]:
    tracer: trace.Tracer = _state["tracer"]
    with tracer.start_as_current_span(f"tiergate.stage {name}", attributes={
            "tiergate.stage": name, "tiergate.tier": tier, **attributes}) as span:
        yield span


@contextmanager
def _own_stage(parent: OwnSpan, name: str, tier: str, attributes: dict[str, Any]) -> Iterator[OwnSpan]:
    """``_stage`` for a request tiergate records itself: the same span (an error ends it with an
    ``exception`` event and status ERROR, as the SDK's ``start_as_current_span`` does)."""
    span = parent.child(f"tiergate.stage {name}", SpanKind.INTERNAL,
                        {"tiergate.stage": name, "tiergate.tier": tier, **attributes})
    token = _current_own.set(span)
    try:
        yield span
    except BaseException as err:
        span.record_exception(err)
        span.set_status(StatusCode.ERROR, f"{type(err).__name__}: {err}")
        raise
    finally:
        _current_own.reset(token)
        span.end()


@contextmanager
def _use_own(span: OwnSpan) -> Iterator[OwnSpan]:
    token = _current_own.set(span)
    try:
        yield span
    finally:
        _current_own.reset(token)


def _sampled_out() -> bool:
    """Whether the current request's trace is not sampled: its children are not either (the
    samplers here are parent-based), so none is started. In a request whose server span is not
    sampled nothing else is ever started, so its span is the current one: its flag decides. With
    a sampler whose children follow their parent (``_state["plan"]``) the request's flag decides
    for a sampled request too, without a look at the current span."""
    s = _request.get()
    if s is not None and (not s.sampled or _state["plan"] is not None):  # plan: children sampled as their parent
        return not s.sampled
    ctx = trace.get_current_span().get_span_context()
    return ctx.is_valid and not ctx.trace_flags.sampled


def stage(name: str, tier: str, **attributes: Any) -> Any:
    """A span around one pipeline stage call (current while it runs), or nothing when off or
    when the request is not sampled."""
    if _state["tracer"] is None or _sampled_out():
        return nullcontext()
    attributes = {k: v for k, v in attributes.items() if v is not None}
    if (parent := _own_parent()) is not None:
        return _own_stage(parent, name, tier, attributes)
    return _stage(name, tier, attributes)


def open_stage(name: str, tier: str, **attributes: Any) -> Any:
    """A stage span for a streamed stage (ended by ``end_on_attempt``), or None when off or
    when the request is not sampled."""
    if _state["tracer"] is None or _sampled_out():
        return None
    attributes = {"tiergate.stage": name, "tiergate.tier": tier,
                  **{k: v for k, v in attributes.items() if v is not None}}
    if (parent := _own_parent()) is not None:
        return parent.child(f"tiergate.stage {name}", SpanKind.INTERNAL, attributes)
    return _state["tracer"].start_span(f"tiergate.stage {name}", attributes=attributes)


def use(span: Any) -> Any:
    """``span`` current for a block (nothing when None)."""
    if span is None:
        return nullcontext()
    return _use_own(span) if isinstance(span, OwnSpan) else trace.use_span(span, end_on_exit=False)


def end_on_attempt(span: Any, on_attempt: Callable[[Any], None]) -> Callable[[Any], None]:
    """``on_attempt`` that also ends ``span`` with the attempt that produced the stream (a
    failed attempt is retried within the stage); ``end(span)`` ends it if none did."""
    if span is None:
        return on_attempt

    def report(attempt: Any) -> None:
        try:
            on_attempt(attempt)
        finally:
            if attempt.status != "error":
                end(span)
    return report


def end(span: Any, error: BaseException | None = None) -> None:
    """End ``span`` once (None and an ended span: nothing)."""
    if span is None or not span.is_recording():
        return
    if error is not None:
        span.set_attribute("error.type", type(error).__name__)
        span.set_status(StatusCode.ERROR)
    span.end()


# -- upstream calls -------------------------------------------------------------------------------
def _trace_headers(span: trace.Span, ctx: otel_context.Context) -> tuple[tuple[str, str], ...]:
    """The headers the configured propagators send upstream for ``span`` in context ``ctx`` (its
    baggage). With the default W3C propagators and no baggage that is ``traceparent`` (and
    ``tracestate`` when the trace has one), written here as the trace context propagator writes
    it; anything else goes through the propagators."""
    sc = span.get_span_context()
    _header_fields(propagate.get_global_textmap())  # _state["w3c"] for the propagators in use now
    if _state["w3c"] and sc.is_valid and not baggage.get_all(ctx):
        traceparent = ("traceparent", f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{sc.trace_flags:02x}")
        return (traceparent, ("tracestate", sc.trace_state.to_header())) if sc.trace_state else (traceparent,)
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span, ctx))
    return tuple(carrier.items())


def _unsampled_headers() -> tuple[tuple[str, str], ...]:
    """The trace context headers for an upstream call of an unsampled request: the current
    context's (its server span's), built once per request and reused while that context is
    current (they depend on nothing else)."""
    s, ctx = _request.get(), otel_context.get_current()
    if s is not None and s.headers is not None and s.headers[0] is ctx:
        return s.headers[1]
    headers = _trace_headers(trace.get_current_span(ctx), ctx)
    if s is not None:
        s.headers = (ctx, headers)
    return headers


def attempt(name: str, model: Any, options: Any, on_attempt: Callable[[Any], None]
            ) -> tuple[Callable[[Any], None], Any]:
    """One upstream attempt about to be made: (its reporter, its options). With tracing on a
    client span is started (a child of whatever is current: the request or a stage), its
    context put in ``options.trace_headers`` for the provider to send upstream, and the
    reporter ends it with the attempt's usage and status before passing the attempt on."""
    tracer = _state["tracer"]
    if tracer is None:
        return on_attempt, options
    s = _request.get()
    if s is not None and s.upstream is not None:  # decided not sampled ahead of the SDK: headers written
        return on_attempt, options.with_trace_headers(s.upstream)
    if _sampled_out():  # no span; the upstream still continues the (unsampled) trace
        return on_attempt, options.with_trace_headers(_unsampled_headers())
    attributes = {"gen_ai.operation.name": "chat", "gen_ai.system": model.provider,
                  "gen_ai.request.model": model.model, "tiergate.model": name}
    span: Any
    if (parent := _own_parent()) is not None:  # no OpenTelemetry context, no baggage: traceparent alone
        span = parent.child(f"chat {model.model}", SpanKind.CLIENT, attributes)
        options = options.with_trace_headers((("traceparent", span.traceparent),))
    else:
        span = tracer.start_span(f"chat {model.model}", kind=SpanKind.CLIENT, attributes=attributes)
        options = options.with_trace_headers(_trace_headers(span, otel_context.get_current()))

    def report(a: Any) -> None:
        try:
            span.set_attributes({"gen_ai.usage.input_tokens": a.usage.prompt_tokens,
                                 "gen_ai.usage.output_tokens": a.usage.completion_tokens,
                                 "tiergate.attempt_status": a.status})
            if a.status == "error":
                span.set_attribute("error.type", str(getattr(a.error, "code", None) or "error"))
                span.set_status(StatusCode.ERROR)
            span.end()
        finally:
            on_attempt(a)
    return report, options
