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

The provider and the request's server span are in gateway.telemetry.request_span (re-exported here).
Imports opentelemetry and settings only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import orjson
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, StatusCode

from gateway.telemetry.own_spans import OwnSpan
from gateway.telemetry.request_span import (
    ServerSpan,
    _current_own,
    _header_fields,
    _own_parent,
    _request,
    _state,
    build_provider,
    configure,
    enabled,
    end_server_span,
    server_span,
)

__all__ = ["ServerSpan", "annotate_completion", "annotate_outcome", "annotate_request", "attempt", "build_provider",
           "configure", "enabled", "end", "end_on_attempt", "end_server_span", "open_stage", "server_span", "stage",
           "use"]

NANOS_PER_USD = 1_000_000_000


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
    if _state["tracer"] is None:
        return
    s = _request.get()  # _pending()'s first case inline: every traced request comes here
    if (attributes := (s.attributes if s.recording else None) if s is not None else _pending()) is None:
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
    if _state["tracer"] is None:
        return
    s = _request.get()  # as in annotate_request
    if (attributes := (s.attributes if s.recording else None) if s is not None else _pending()) is None:
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


def attempt(name: str, model: Any, options: Any, on_attempt: Callable[[Any], None], call_id: str | None = None
            ) -> tuple[Callable[[Any], None], Any]:
    """One upstream attempt about to be made (``call_id``: its ledger row's id, if journaled):
    (its reporter, its options, with ``call_id`` set). With tracing on a client span is started
    (a child of whatever is current: the request or a stage), its context put in
    ``options.trace_headers`` for the provider to send upstream, and the reporter ends it with
    the attempt's usage and status before passing the attempt on."""
    tracer = _state["tracer"]
    if tracer is None:
        return on_attempt, options.with_call_id(call_id)
    s = _request.get()
    if s is not None and s.upstream is not None:  # decided not sampled ahead of the SDK: headers written
        return on_attempt, options.with_call(call_id, s.upstream)
    options = options.with_call_id(call_id)
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
