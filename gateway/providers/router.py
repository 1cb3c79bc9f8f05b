"""Calling a tier: retries with exponential backoff + full jitter on 429/5xx/timeouts (honouring
``retry-after``), then the tier's ordered fallbacks.

Every upstream attempt — failed, answered, streamed to the end or cut short — is reported once
through ``on_attempt`` with its usage, so the caller can bill it (the ledger lives above this
layer). Streams can only be retried before their first chunk; after that an error ends the
stream. Imports settings, errors and sibling provider modules only.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gateway.errors import GatewayError, UpstreamError
from gateway.providers.base import CallOptions, ChunkStream, Usage
from gateway.providers.metering import StreamMeter, count_prompt_tokens, response_usage
from gateway.providers.payload import provider_payload
from gateway.providers.registry import ProviderRegistry
from gateway.settings import ModelSettings, Settings
from gateway.telemetry import metrics, tracing

AttemptStatus = Literal["ok", "error", "cancelled"]
log = logging.getLogger("tiergate.providers")


@dataclass(frozen=True)
class Attempt:
    """One upstream call, as the ledger needs it."""

    model_name: str
    usage: Usage
    status: AttemptStatus
    latency_ms: int
    error: GatewayError | None = None
    call_id: str | None = None  # what ``begin`` returned for this call (its ledger row's id)


@dataclass(frozen=True)
class CallStart:
    """An upstream call about to be made: what its intent records (see ``Billing``)."""

    model_name: str
    prompt_tokens: int
    max_output_tokens: int  # every choice at the output cap sent upstream (else the context window)


OnAttempt = Callable[[Attempt], None]


class Billing(Protocol):
    """An ``on_attempt`` that also journals each call before it is made: ``begin`` returns once
    the call's intent is written (or raises, and the call is not made) and gives the call id the
    ``Attempt`` then carries. The router calls it when ``on_attempt`` has it."""

    def __call__(self, attempt: Attempt) -> None: ...

    async def begin(self, start: CallStart) -> str: ...


def call_start(name: str, model: ModelSettings, payload: dict[str, Any]) -> CallStart:
    prompt = count_prompt_tokens(model, payload.get("messages") or [])
    cap = payload.get("max_completion_tokens") or payload.get("max_tokens")
    out = int(cap) if isinstance(cap, int) and cap > 0 else max(model.context_window - prompt, 0)
    n = payload.get("n")
    return CallStart(name, prompt, out * (n if isinstance(n, int) and n > 1 else 1))


async def _begin(on_attempt: OnAttempt, name: str, model: ModelSettings, payload: dict[str, Any]) -> str | None:
    begin = getattr(on_attempt, "begin", None)
    if begin is None:
        return None
    call_id: str = await begin(call_start(name, model, payload))
    return call_id
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class RetryPolicy:
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0
    max_retry_after_s: float = 30.0

    def delay(self, attempt: int, err: GatewayError) -> float:
        retry_after = err.headers.get("retry-after") if err.headers else None
        if retry_after:
            try:
                return min(max(float(retry_after), 0.0), self.max_retry_after_s)
            except ValueError:
                pass  # an HTTP date: fall through to backoff
        return random.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** attempt))


DEFAULT_POLICY = RetryPolicy()


def tier_models(settings: Settings, tier: str) -> list[str]:
    t = settings.tiers[tier]  # type: ignore[index]
    return [t.model, *t.fallbacks]


def _noop(_: Attempt) -> None:
    return None


def _ms(start: float) -> int:
    return int((time.perf_counter() - start) * 1000)


def _retryable(err: GatewayError) -> bool:
    return isinstance(err, UpstreamError) and err.retryable


async def _wait_to_retry(name: str, attempt: int, max_retries: int, err: GatewayError,
                         policy: RetryPolicy, sleep: Sleep) -> bool:
    """After a failed attempt at model ``name``: re-raise a client error (400: no retry, no
    fallback); otherwise sleep the policy's delay and return True to retry the same model, or
    return False (retries spent, or not retryable) to go on to the next fallback."""
    if not isinstance(err, UpstreamError):
        raise err
    if not err.retryable or attempt == max_retries:
        log.warning("upstream model %s failed (%s, HTTP %s); trying the next fallback", name,
                    type(err).__name__, err.upstream_status)
        return False
    delay = policy.delay(attempt, err)
    log.debug("upstream model %s attempt %d failed (%s, HTTP %s); retrying in %.2fs", name,
              attempt + 1, type(err).__name__, err.upstream_status, delay)
    await sleep(delay)
    return True


async def call_models(registry: ProviderRegistry, models: Sequence[str], body: dict[str, Any],
                      options: CallOptions = CallOptions(), *, on_attempt: OnAttempt = _noop,
                      policy: RetryPolicy = DEFAULT_POLICY, sleep: Sleep = asyncio.sleep,
                      ) -> tuple[dict[str, Any], str]:
    """Non-streaming call over an ordered chain of models; returns (response, model used)."""
    journal = on_attempt  # its ``begin``, if any, journals each call before it is made
    if metrics.enabled():  # every attempt counted (gateway.telemetry.metrics)
        on_attempt = metrics.observed(on_attempt)
    last: GatewayError | None = None
    for name in models:
        model = registry.model(name)
        provider = registry.for_model(name)
        payload = provider_payload(name, model, body)  # a 400 here is raised before any call
        for attempt in range(model.max_retries + 1):
            call_id = await _begin(journal, name, model, payload)  # raises: no call is made
            start = time.perf_counter()
            report, call_options = tracing.attempt(name, model, options, on_attempt, call_id)
            try:
                response = await provider.complete(model, payload, call_options)
            except GatewayError as err:
                report(Attempt(name, Usage(), "error", _ms(start), err, call_id))
                last = err
                if await _wait_to_retry(name, attempt, model.max_retries, err, policy, sleep):
                    continue
                break
            except asyncio.CancelledError:
                report(Attempt(name, Usage(), "cancelled", _ms(start), call_id=call_id))
                raise
            report(Attempt(name, response_usage(model, payload.get("messages") or [], response), "ok",
                               _ms(start), call_id=call_id))
            return response, name
    assert last is not None
    raise last


async def call_tier(registry: ProviderRegistry, settings: Settings, tier: str, body: dict[str, Any],
                    options: CallOptions = CallOptions(), *, on_attempt: OnAttempt = _noop,
                    policy: RetryPolicy = DEFAULT_POLICY, sleep: Sleep = asyncio.sleep,
                    ) -> tuple[dict[str, Any], str]:
    return await call_models(registry, tier_models(settings, tier), body, options,
                             on_attempt=on_attempt, policy=policy, sleep=sleep)


class MeteredStream:
    """The chunks of one opened upstream stream. Reports its attempt exactly once: at the end of
    the stream, on an upstream error, or on ``aclose`` (client went away: the upstream connection
    is closed first so it stops generating, then what was generated is billed)."""

    def __init__(self, first: dict[str, Any], rest: AsyncGenerator[dict[str, Any], None], meter: StreamMeter,
                 name: str, start: float, on_attempt: OnAttempt, call_id: str | None = None) -> None:
        self.call_id = call_id
        self._first: dict[str, Any] | None = first
        self._rest = rest
        self.meter = meter
        self.model_name = name
        self._start = start
        self._on_attempt = on_attempt
        self._reported = False

    def __aiter__(self) -> MeteredStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._reported:
            raise StopAsyncIteration
        if self._first is not None:
            first, self._first = self._first, None
            return first
        try:
            chunk = await self._rest.__anext__()
        except StopAsyncIteration:
            self._report("ok")
            raise
        except GatewayError as err:
            await self._rest.aclose()
            self._report("error", err)
            raise
        except asyncio.CancelledError:
            await self.aclose()
            raise
        self.meter.observe(chunk)
        return chunk

    def _report(self, status: AttemptStatus, error: GatewayError | None = None) -> None:
        if not self._reported:
            self._reported = True
            self._on_attempt(Attempt(self.model_name, self.meter.usage(), status, _ms(self._start), error,
                                     self.call_id))

    async def aclose(self) -> None:
        if self._reported:
            return
        try:
            await self._rest.aclose()
        finally:
            self._report("cancelled")


async def stream_models(registry: ProviderRegistry, models: Sequence[str], body: dict[str, Any],
                        options: CallOptions = CallOptions(), *, on_attempt: OnAttempt = _noop,
                        policy: RetryPolicy = DEFAULT_POLICY, sleep: Sleep = asyncio.sleep,
                        ) -> tuple[ChunkStream, str]:
    """Open a stream over an ordered chain of models: retries and fallbacks until the first chunk
    arrives. Returns (chunks, model used); the attempt is reported when the stream ends."""
    journal = on_attempt  # its ``begin``, if any, journals each call before it is made
    if metrics.enabled():
        on_attempt = metrics.observed(on_attempt)
    last: GatewayError | None = None
    for name in models:
        model = registry.model(name)
        provider = registry.for_model(name)
        payload = provider_payload(name, model, body)  # a 400 here is raised before any call
        for attempt in range(model.max_retries + 1):
            call_id = await _begin(journal, name, model, payload)  # raises: no call is made
            start = time.perf_counter()
            report, call_options = tracing.attempt(name, model, options, on_attempt, call_id)
            chunks = provider.stream(model, payload, call_options)
            meter = StreamMeter(model, payload.get("messages") or [])
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                # Nothing at all came back: bill the prompt, hand back an empty stream.
                report(Attempt(name, meter.usage(), "ok", _ms(start), call_id=call_id))
                return _empty(), name
            except GatewayError as err:
                report(Attempt(name, Usage(), "error", _ms(start), err, call_id))
                last = err
                if await _wait_to_retry(name, attempt, model.max_retries, err, policy, sleep):
                    continue
                break
            except asyncio.CancelledError:
                await chunks.aclose()
                report(Attempt(name, meter.usage(), "cancelled", _ms(start), call_id=call_id))
                raise
            meter.observe(first)
            return MeteredStream(first, chunks, meter, name, start, report, call_id), name
    assert last is not None
    raise last


async def stream_tier(registry: ProviderRegistry, settings: Settings, tier: str, body: dict[str, Any],
                      options: CallOptions = CallOptions(), *, on_attempt: OnAttempt = _noop,
                      policy: RetryPolicy = DEFAULT_POLICY, sleep: Sleep = asyncio.sleep,
                      ) -> tuple[ChunkStream, str]:
    return await stream_models(registry, tier_models(settings, tier), body, options,
                               on_attempt=on_attempt, policy=policy, sleep=sleep)


async def _empty() -> AsyncGenerator[dict[str, Any], None]:
    return
    yield  # pragma: no cover - makes this an async generator
