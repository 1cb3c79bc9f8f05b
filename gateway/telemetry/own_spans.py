"""Spans tiergate records itself (gateway.telemetry.tracing's sampled requests): ``OwnRecording``
(when a provider allows it, and where ended spans go) and ``OwnSpan`` (one span: ids, a plain
attribute dict, a status; ended into the ``ReadableSpan`` the SDK's ``Span.end`` would hand the
span processors).

Imports opentelemetry only.
"""

from __future__ import annotations

import random
import time
import traceback
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SynchronousMultiSpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

# The processors whose on_start does nothing: a span they get only at its end loses nothing.
_END_ONLY_PROCESSORS = (BatchSpanProcessor, SimpleSpanProcessor)


class OwnRecording:
    """What tiergate needs to record a sampled request's spans itself and hand them, ended, to the
    provider's span processors as the SDK's ``Span.end`` does (a ``ReadableSpan`` to ``on_end``):
    the provider's processors, resource and the tracer's instrumentation scope. Only for an SDK
    provider whose tracer is enabled, whose span limits leave tiergate's attributes as they are
    (no value length limit, room for them all), and whose processors are all the SDK's batch or
    simple ones (their ``on_start`` does nothing, so a span they see only at its end loses
    nothing); ``usable`` re-checks the processors (one may be added later) by the identity of
    their tuple. Anything else: the SDK records every span, as without this."""

    __slots__ = ("info", "multi", "processors", "resource", "scope")

    def __init__(self, multi: SynchronousMultiSpanProcessor, resource: Resource, scope: Any, info: Any) -> None:
        self.multi, self.resource, self.scope, self.info = multi, resource, scope, info
        self.processors: tuple[Any, ...] | None = None

    @classmethod
    def of(cls, provider: Any, tracer: Any) -> OwnRecording | None:
        multi = getattr(provider, "_active_span_processor", None)
        limits = getattr(provider, "_span_limits", None)
        enabled = getattr(tracer, "_is_enabled", None)
        if (type(multi) is not SynchronousMultiSpanProcessor or limits is None or enabled is None or not enabled()
                or getattr(limits, "max_attribute_length", 0) is not None
                or (getattr(limits, "max_span_attributes", 0) or 0) < 64
                or not hasattr(tracer, "_instrumentation_scope")):
            return None
        return cls(multi, provider.resource, tracer._instrumentation_scope, getattr(tracer, "instrumentation_info", None))

    def usable(self) -> bool:
        processors = self.multi._span_processors  # replaced, not mutated, when one is added
        if processors is not self.processors:
            if not all(type(p) in _END_ONLY_PROCESSORS for p in processors):
                return False
            self.processors = processors
        return True


class OwnSpan:
    """A sampled span tiergate records itself: what the SDK's ``Span`` keeps for it, without its
    locks, per-attribute validation and context objects, and the part of the ``Span`` interface
    tiergate's code uses (``is_recording``, ``set_attribute(s)``, ``set_status``, ``update_name``,
    ``end``, ``get_span_context``). Ended once: a ``ReadableSpan`` (attributes without the
    ``None`` values the SDK would drop) goes to the provider's processors."""

    __slots__ = ("attributes", "context", "ended", "events", "kind", "name", "own", "parent", "start", "status")

    def __init__(self, own: OwnRecording, name: str, kind: SpanKind, context: trace.SpanContext,
                 parent: trace.SpanContext | None, attributes: dict[str, Any] | None = None) -> None:
        self.own, self.name, self.kind, self.context, self.parent = own, name, kind, context, parent
        self.attributes: dict[str, Any] = attributes if attributes is not None else {}
        self.start, self.ended, self.status = time.time_ns(), False, _UNSET
        self.events: tuple[Event, ...] = ()

    def child(self, name: str, kind: SpanKind, attributes: dict[str, Any] | None = None) -> OwnSpan:
        ctx = self.context
        return OwnSpan(self.own, name, kind, trace.SpanContext(ctx.trace_id, _new_span_id(), False, ctx.trace_flags),
                       ctx, attributes)

    def is_recording(self) -> bool:
        return not self.ended

    def get_span_context(self) -> trace.SpanContext:
        return self.context

    def set_attribute(self, key: str, value: Any) -> None:
        if not self.ended:
            self.attributes[key] = value

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        if not self.ended:
            self.attributes.update(attributes)

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if not self.ended:
            self.status = status if isinstance(status, Status) else Status(status, description)

    def update_name(self, name: str) -> None:
        if not self.ended:
            self.name = name

    def record_exception(self, error: BaseException) -> None:
        """An ``exception`` event as the SDK records one (type, message, stack trace)."""
        self.events = (*self.events, Event("exception", {
            "exception.type": type(error).__qualname__, "exception.message": str(error),
            "exception.stacktrace": "".join(traceback.format_exception(error)), "exception.escaped": "False"}))

    @property
    def traceparent(self) -> str:
        ctx = self.context
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        own = self.own
        own.multi.on_end(ReadableSpan(
            name=self.name, context=self.context, parent=self.parent, resource=own.resource,
            attributes={k: v for k, v in self.attributes.items() if v is not None}, events=self.events,
            kind=self.kind, status=self.status, start_time=self.start, end_time=time.time_ns(),
            instrumentation_info=own.info, instrumentation_scope=own.scope))


_UNSET = Status(StatusCode.UNSET)


def _new_span_id() -> int:
    span_id = random.getrandbits(64)
    while not span_id:
        span_id = random.getrandbits(64)
    return span_id
