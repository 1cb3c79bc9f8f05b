"""The litellm provider (every non-OpenAI-compatible provider string) against the scripted
upstream, reached through litellm's ``openai/`` route: completion, streaming, error mapping,
and that the URL and key come from config only."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest, UpstreamError
from gateway.providers.base import CALL_ID_HEADER, CallOptions, Usage
from gateway.providers.litellm_provider import LiteLLMProvider
from gateway.providers.registry import ProviderRegistry
from gateway.providers.router import Attempt, call_models
from gateway.settings import ModelSettings, settings_from_dict
from tests.gateway.scripted_upstream import (
    UPSTREAM_KEY,
    UPSTREAM_KEY_ENV,
    Behaviour,
    ScriptedUpstream,
    config_for,
)

pytestmark = pytest.mark.slow  # importing litellm alone takes ~4 s

MSGS = [{"role": "user", "content": "hello"}]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _model(up: ScriptedUpstream) -> ModelSettings:
    return ModelSettings(provider="litellm", model="openai/upstream-ll", api_base=up.base_url,
                         api_key_env=UPSTREAM_KEY_ENV, timeout_s=5, max_retries=0)


async def test_complete_and_stream(upstream: ScriptedUpstream) -> None:
    provider, model = LiteLLMProvider(), _model(upstream)
    resp = await provider.complete(model, {"messages": MSGS, "max_tokens": 3, "seed": 1})
    assert resp["choices"][0]["message"]["content"] == "w0 w1 w2"
    assert Usage.from_openai(resp["usage"]) == Usage(11, 3)
    got = upstream.requests[-1]
    assert got.body["model"] == "upstream-ll" and got.body["seed"] == 1
    assert got.headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"

    assert "X-Client-Request-Id" not in got.headers and "traceparent" not in got.headers  # none given

    options = CallOptions(trace_headers=(("traceparent", TRACEPARENT),)).with_call_id("call-1")
    chunks = [c async for c in provider.stream(model, {"messages": MSGS, "max_tokens": 4}, options)]
    assert upstream.requests[-1].headers[CALL_ID_HEADER] == "call-1"  # as the lean client sends them
    assert upstream.requests[-1].headers["traceparent"] == TRACEPARENT
    text = "".join((c["choices"][0].get("delta") or {}).get("content") or "" for c in chunks if c.get("choices"))
    assert text == "w0 w1 w2 w3"
    assert upstream.requests[-1].body["stream_options"] == {"include_usage": True}
    assert any((c.get("usage") or {}).get("completion_tokens") == 4 for c in chunks)


@pytest.mark.parametrize(("status", "kind", "retryable"), [(429, UpstreamError, True), (500, UpstreamError, True),
                                                           (400, InvalidRequest, None)])
async def test_errors_map_to_the_gateway_tree(upstream: ScriptedUpstream, status: int, kind: type,
                                              retryable: bool | None) -> None:
    upstream.push(Behaviour(status=status))
    with pytest.raises(kind) as info:
        await LiteLLMProvider().complete(_model(upstream), {"messages": MSGS})
    if retryable is not None:
        assert info.value.retryable is retryable
    assert UPSTREAM_KEY not in str(info.value)


async def test_router_falls_back_from_litellm_to_openai_compat(upstream: ScriptedUpstream) -> None:
    cfg = config_for(upstream.base_url)
    cfg["models"]["ll"] = {"provider": "litellm", "model": "openai/upstream-ll", "api_base": upstream.base_url,
                           "api_key_env": UPSTREAM_KEY_ENV, "max_retries": 0}
    settings = settings_from_dict(cfg)
    upstream.push(Behaviour(status=503))
    reg, attempts = ProviderRegistry(settings), []
    try:
        _, used = await call_models(reg, ["ll", "up-a"], {"messages": MSGS}, on_attempt=attempts.append)
    finally:
        await reg.aclose()
    assert used == "up-a"
    assert [(a.model_name, a.status) for a in attempts] == [("ll", "error"), ("up-a", "ok")]
    assert isinstance(attempts[0], Attempt)
