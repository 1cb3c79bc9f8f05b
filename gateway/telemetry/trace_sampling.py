"""A request's sampling decision taken ahead of the OpenTelemetry SDK (gateway.telemetry.tracing).

Going through the SDK, a request that is not sampled still pays for the SDK's machinery — the
current context looked up, a sampler consulted, span context objects built, a context attached
and detached — about 130 Python calls for a span nothing records. Where the tracer provider's
sampler is one whose decision tiergate can reproduce exactly (``ParentBased`` with its default
delegates, its root ``ALWAYS_OFF``, ``ALWAYS_ON`` or ``TraceIdRatioBased``, random ids), the
decision is taken here instead (``decide``):

* no incoming trace context: a random trace id is drawn as the SDK's ``RandomIdGenerator``
  draws it and tested as ``TraceIdRatioBased`` tests it (its low 64 bits below the ratio's
  bound), so a trace id's decision is the same here, in the SDK and in any service downstream
  that samples by trace id ratio. A root sampled in is handed to the SDK with that trace id
  (``PresetTraceIds``, the id generator ``build_provider`` installs), whose own sampler then
  agrees; without that generator only ``ALWAYS_OFF`` roots are decided here;
* an incoming W3C ``traceparent`` (version 00, alone: no ``tracestate``) that is not sampled:
  continued, not sampled, as the parent-based sampler would;
* anything else (a sampled parent, ``tracestate``, a malformed header, an unknown sampler): the
  SDK decides, as without this module.

A request decided not sampled gets its trace id and a new span id and the ``traceparent`` it
sends upstream, written once; no span object, no OpenTelemetry context. Its flags are the SDK's
for the same span: not sampled, and the W3C "random trace id" flag (0x02) when the SDK would set
it (a root of random ids; a parent's flag continued).

Imports opentelemetry only.
"""

from __future__ import annotations

import random
import re
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NamedTuple

from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased

TRACE_ID_LIMIT = (1 << 64) - 1  # TraceIdRatioBased tests a trace id's low 64 bits
ALL_ROOTS = 1 << 64  # a bound every trace id's low 64 bits are below: ALWAYS_ON
SAMPLED = 0x01
RANDOM_TRACE_ID = 0x02  # W3C trace flags: the trace id is random (the SDK sets it for its random ids)
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_preset: ContextVar[int] = ContextVar("tiergate_preset_trace_id", default=0)


class PresetTraceIds(RandomIdGenerator):
    """The SDK's random ids, except the trace id of a root span whose sampling tiergate decided
    (``preset``: the id it drew and tested), so the SDK's ratio sampler sees the same id."""

    def generate_trace_id(self) -> int:
        return _preset.get() or super().generate_trace_id()


def preset(trace_id: int) -> Any:
    """Make ``trace_id`` the next root trace id of a ``PresetTraceIds`` in this context (a token
    for ``clear``)."""
    return _preset.set(trace_id)


def clear(token: Any) -> None:
    _preset.reset(token)


@dataclass(frozen=True)
class Plan:
    """What tiergate decides for a provider: roots (``bound``: sampled when the trace id's low
    64 bits are below it; None: the SDK decides them) and unsampled remote parents (always,
    with a plan at all); ``presets``: whether a root sampled in can keep the drawn trace id;
    ``random_ids``: whether the provider's ids are the SDK's random ones (so a span tiergate
    records itself — gateway.telemetry.tracing's own recording — may draw its own ids, and a
    root under ``ALWAYS_ON`` is decided here too: ``bound`` is then ``ALL_ROOTS``).
    With a plan, a span's children are sampled exactly when it is (the default delegates)."""

    bound: int | None
    presets: bool
    random_ids: bool = False


def plan(provider: Any) -> Plan | None:
    """The decisions tiergate can take for ``provider`` (an SDK TracerProvider) exactly as its
    sampler would; None: none (every request through the SDK)."""
    sampler, ids = getattr(provider, "sampler", None), getattr(provider, "id_generator", None)
    if type(sampler) is not ParentBased or any(getattr(sampler, name, None) is not default for name, default in (
            ("_remote_parent_sampled", ALWAYS_ON), ("_remote_parent_not_sampled", ALWAYS_OFF),
            ("_local_parent_sampled", ALWAYS_ON), ("_local_parent_not_sampled", ALWAYS_OFF))):
        return None  # not the parent-based sampler with its default delegates: not reproduced here
    root, presets = getattr(sampler, "_root", None), isinstance(ids, PresetTraceIds)
    random_ids = type(ids) in (RandomIdGenerator, PresetTraceIds)
    if root is ALWAYS_OFF and isinstance(ids, RandomIdGenerator):
        return Plan(0, presets, random_ids)
    if type(root) is TraceIdRatioBased and (presets or random_ids) and root.bound <= TRACE_ID_LIMIT:
        return Plan(root.bound, presets, random_ids)  # without presets: only for tiergate's own recording
    if root is ALWAYS_ON and random_ids:  # every root sampled: decided here only for tiergate's own recording
        return Plan(ALL_ROOTS, presets, random_ids)
    return Plan(None, presets, random_ids)  # not reproducible


class Decision(NamedTuple):
    """A request's server span decided here: its trace id, sampled or not, its new span id and its
    trace flags (a root sampled in for the SDK has neither: the SDK draws its span id), and the
    remote parent's span id when it continues a client's trace (a named tuple: built in half a
    frozen dataclass's time)."""

    trace_id: int
    sampled: bool
    span_id: int = 0
    flags: int = 0
    parent_id: int = 0

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{self.flags:02x}"


def _span_id() -> int:
    span_id = random.getrandbits(64)
    while not span_id:
        span_id = random.getrandbits(64)
    return span_id


def decide(p: Plan, carrier: dict[str, str] | None, own: bool = False) -> Decision | None:
    """The decision for a request whose trace context headers are ``carrier`` (None: none), or
    None where the SDK decides. Only with the default W3C propagators and no ambient context
    (the caller checks). ``own``: a sampled request is recorded by tiergate itself (its provider
    allows it and ``p.random_ids``), so a root sampled in and a client's sampled ``traceparent``
    are decided here too, with the span id and flags the SDK would give them; without it those
    are the SDK's (a root sampled in: handed over with its drawn trace id)."""
    if carrier is None:
        if p.bound is None or (not own and p.bound and (p.bound == ALL_ROOTS or not p.presets)):
            return None  # a root that may be sampled in, and the SDK could not keep the drawn id
        trace_id = random.getrandbits(128)
        while not trace_id:
            trace_id = random.getrandbits(128)
        if trace_id & TRACE_ID_LIMIT < p.bound:
            return Decision(trace_id, True, _span_id(), SAMPLED | RANDOM_TRACE_ID) if own else Decision(trace_id, True)
        span_id = random.getrandbits(64)  # _span_id() inline: every request not sampled comes here
        return Decision(trace_id, False, span_id or _span_id(), RANDOM_TRACE_ID)
    header = carrier.get("traceparent")
    if header is None or len(carrier) != 1 or (m := _TRACEPARENT.fullmatch(header)) is None:
        return None
    trace_id, parent_id, flags = int(m[1], 16), int(m[2], 16), int(m[3], 16)
    if not trace_id or not parent_id:
        return None  # invalid (the SDK starts a new trace)
    if flags & SAMPLED:  # a sampled parent: its children sampled (the default delegates)
        return Decision(trace_id, True, _span_id(), SAMPLED | flags & RANDOM_TRACE_ID, parent_id) if own else None
    return Decision(trace_id, False, _span_id(), flags & RANDOM_TRACE_ID, parent_id)

