"""The OpenAI-compatible client and the tier router against the scripted upstream: pass-through,
streaming, retries honouring retry-after, fallbacks, timeouts, per-attempt metering, cancel."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gateway.errors import InvalidRequest, UpstreamError, UpstreamTimeout
from gateway.providers.base import CallOptions, Usage
from gateway.providers.registry import ProviderRegistry
from gateway.providers.router import Attempt, RetryPolicy, call_tier, stream_tier
from gateway.settings import Settings, settings_from_dict
from tests.gateway.scripted_upstream import (
    UPSTREAM_KEY,
    Behaviour,
    ScriptedUpstream,
    config_for,
)

MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture
def settings(upstream: ScriptedUpstream) -> Settings:
    return settings_from_dict(config_for(upstream.base_url))


class Sleeps:
    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, s: float) -> None:
        self.calls.append(s)


async def test_complete_passes_fields_and_uses_config_url_and_key(upstream: ScriptedUpstream,
                                                                  settings: Settings) -> None:
    reg = ProviderRegistry(settings)
    attempts: list[Attempt] = []
    body = {"messages": MSGS, "max_tokens": 3, "temperature": 0.2, "seed": 7, "user": "u1",
            "metadata": {"a": "b"}, "reasoning_effort": "low", "verbosity": "low"}
    try:
        resp, model = await call_tier(reg, settings, "medium", body, on_attempt=attempts.append)
    finally:
        await reg.aclose()
    assert model == "up-a"
    assert resp["choices"][0]["message"]["content"] == "w0 w1 w2"
    got = upstream.requests[-1]
    assert got.body["model"] == "upstream-a" and got.body["stream"] is False
    for key in ("temperature", "seed", "user", "reasoning_effort", "verbosity"):
        assert got.body[key] == body[key]
    assert "metadata" not in got.body  # accepted from clients, never forwarded
    assert got.headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert [a.status for a in attempts] == ["ok"]
    assert attempts[0].usage == Usage(prompt_tokens=11, completion_tokens=3)


async def test_a_field_outside_the_providers_allow_list_is_refused_before_any_call(
        upstream: ScriptedUpstream, settings: Settings) -> None:
    reg = ProviderRegistry(settings)
    attempts: list[Attempt] = []
    try:
        for field, value in (("brand_new_field", 1), ("fallbacks", [{"api_base": "http://evil"}]),
                             ("api_base", "http://evil"), ("top_k", 5)):
            with pytest.raises(InvalidRequest) as caught:
                await call_tier(reg, settings, "medium", {"messages": MSGS, field: value},
                                on_attempt=attempts.append)
            assert caught.value.param == field and caught.value.code == "unsupported_parameter"
    finally:
        await reg.aclose()
    assert upstream.requests == [] and attempts == []  # no HTTP call, so no ledger row either


async def test_retries_honour_retry_after_then_succeed(upstream: ScriptedUpstream, settings: Settings) -> None:
    upstream.push(Behaviour(status=429, retry_after="1.5"), Behaviour(status=503))
    reg, sleeps, attempts = ProviderRegistry(settings), Sleeps(), []
    try:
        resp, model = await call_tier(reg, settings, "medium", {"messages": MSGS}, on_attempt=attempts.append,
                                      sleep=sleeps, policy=RetryPolicy(base_delay_s=0.1, max_delay_s=0.2))
    finally:
        await reg.aclose()
    assert model == "up-a" and resp["choices"]
    assert sleeps.calls[0] == 1.5  # retry-after honoured
    assert 0 <= sleeps.calls[1] <= 0.2  # then exponential backoff with jitter, capped
    assert [a.status for a in attempts] == ["error", "error", "ok"]
    assert len(upstream.requests) == 3


async def test_falls_back_to_next_model_after_retries(upstream: ScriptedUpstream, settings: Settings) -> None:
    upstream.push(*[Behaviour(status=500)] * 3)  # up-a: 1 try + 2 retries
    reg, attempts = ProviderRegistry(settings), []
    try:
        _, model = await call_tier(reg, settings, "low", {"messages": MSGS}, on_attempt=attempts.append,
                                   sleep=Sleeps())
    finally:
        await reg.aclose()
    assert model == "up-b"
    assert [r.body["model"] for r in upstream.requests] == ["upstream-a"] * 3 + ["upstream-b"]
    assert [(a.model_name, a.status) for a in attempts] == [("up-a", "error")] * 3 + [("up-b", "ok")]


async def test_client_errors_are_not_retried(upstream: ScriptedUpstream, settings: Settings) -> None:
    upstream.push(Behaviour(status=400))
    reg = ProviderRegistry(settings)
    try:
        with pytest.raises(InvalidRequest):
            await call_tier(reg, settings, "low", {"messages": MSGS}, sleep=Sleeps())
    finally:
        await reg.aclose()
    assert len(upstream.requests) == 1


async def test_exhausted_chain_raises_upstream_error(upstream: ScriptedUpstream, settings: Settings) -> None:
    upstream.push(*[Behaviour(status=502)] * 3)
    reg = ProviderRegistry(settings)
    try:
        with pytest.raises(UpstreamError) as info:
            await call_tier(reg, settings, "medium", {"messages": MSGS}, sleep=Sleeps())
    finally:
        await reg.aclose()
    assert info.value.status == 502 and UPSTREAM_KEY not in info.value.message


async def test_timeout_maps_to_504(upstream: ScriptedUpstream, settings: Settings) -> None:
    upstream.push(Behaviour(hang_s=2.0))
    chain = settings.model_copy(update={"models": {**settings.models, "up-a": settings.models["up-a"].model_copy(
        update={"max_retries": 0})}})
    reg = ProviderRegistry(chain)
    try:
        with pytest.raises(UpstreamTimeout) as info:
            await call_tier(reg, chain, "medium", {"messages": MSGS}, CallOptions(timeout_s=0.3))
    finally:
        await reg.aclose()
    assert info.value.status == 504


async def test_stream_with_usage_and_metering(upstream: ScriptedUpstream, settings: Settings) -> None:
    reg, attempts = ProviderRegistry(settings), []
    try:
        chunks, _ = await stream_tier(reg, settings, "medium", {"messages": MSGS, "max_tokens": 4},
                                          on_attempt=attempts.append)
        got = [c async for c in chunks]
    finally:
        await reg.aclose()
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in got if c.get("choices"))
    assert text == "w0 w1 w2 w3"
    assert upstream.requests[-1].body["stream_options"] == {"include_usage": True}  # always asked
    assert got[-1]["usage"]["completion_tokens"] == 4
    assert attempts == [Attempt("up-a", Usage(11, 4), "ok", attempts[0].latency_ms)]


async def test_stream_without_upstream_usage_is_counted(upstream: ScriptedUpstream, settings: Settings) -> None:
    upstream.push(Behaviour(omit_usage=True, n_words=5))
    reg, attempts = ProviderRegistry(settings), []
    try:
        chunks, _ = await stream_tier(reg, settings, "medium", {"messages": MSGS}, on_attempt=attempts.append)
        async for _c in chunks:
            pass
    finally:
        await reg.aclose()
    (a,) = attempts
    assert a.status == "ok"
    assert a.usage.completion_tokens >= 5  # counted with the tokenizer: "w0 w1 w2 w3 w4"
    assert a.usage.prompt_tokens > 0


async def test_stream_retries_before_first_chunk(upstream: ScriptedUpstream, settings: Settings) -> None:
    upstream.push(Behaviour(status=429, retry_after="0"))
    reg, attempts = ProviderRegistry(settings), []
    try:
        chunks, _ = await stream_tier(reg, settings, "medium", {"messages": MSGS}, on_attempt=attempts.append,
                                      sleep=Sleeps())
        async for _c in chunks:
            pass
    finally:
        await reg.aclose()
    assert [a.status for a in attempts] == ["error", "ok"]


async def test_closing_a_stream_cancels_upstream_and_bills_generated(upstream: ScriptedUpstream,
                                                                     settings: Settings) -> None:
    upstream.push(Behaviour(chunk_delay_s=0.05, n_words=200))
    reg, attempts = ProviderRegistry(settings), []
    try:
        chunks, _ = await stream_tier(reg, settings, "medium", {"messages": MSGS}, on_attempt=attempts.append)
        seen = 0
        async for _c in chunks:
            seen += 1
            if seen == 4:
                break
        await chunks.aclose()  # type: ignore[attr-defined]
        for _ in range(100):
            if upstream.disconnects:
                break
            await asyncio.sleep(0.02)
    finally:
        await reg.aclose()
    assert upstream.disconnects == 1 and upstream.completed_streams == 0
    (a,) = attempts
    assert a.status == "cancelled"
    assert 2 <= a.usage.completion_tokens < 50  # what was generated, not the full 200 words


def test_call_options_with_trace_headers_is_replace() -> None:
    """The copy tracing makes per attempt equals ``dataclasses.replace`` for every field set, and
    leaves the original as it was."""
    values = {f.name: f"v-{f.name}" for f in dataclasses.fields(CallOptions)}
    options = CallOptions(**values)  # type: ignore[arg-type]
    headers = (("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"),)
    copy = options.with_trace_headers(headers)
    assert copy == dataclasses.replace(options, trace_headers=headers) and type(copy) is CallOptions
    assert hash(copy) == hash(dataclasses.replace(options, trace_headers=headers))
    assert options == CallOptions(**values) and copy.trace_headers == headers  # type: ignore[arg-type]
