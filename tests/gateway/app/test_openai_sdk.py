"""The official openai SDK and litellm, used unmodified as clients of a real tiergate (uvicorn on
a loopback port, SQLite, real ledger and key store) in front of the scripted upstream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway.gateway_harness import Gateway, served_gateway
from tests.gateway.scripted_upstream import UPSTREAM_KEY, UPSTREAM_KEY_ENV, ScriptedUpstream

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Gateway]]:
    monkeypatch.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    with ScriptedUpstream() as up, served_gateway(tmp_path, up) as pair:
        yield pair


def test_openai_sdk_unmodified(served: tuple[str, Gateway]) -> None:
    base, gw = served
    client = openai.OpenAI(base_url=base, api_key=gw.key, max_retries=0)

    r = client.chat.completions.create(model="tier-low", messages=MSGS, max_tokens=3)  # type: ignore[arg-type]
    assert r.choices[0].message.content == "w0 w1 w2" and r.model == "tier-low" and r.id.startswith("chatcmpl-")
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (11, 3)

    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="auto", messages=MSGS, max_tokens=4, stream=True) if c.choices)  # type: ignore[arg-type]
    assert text == "w0 w1 w2 w3"

    chunks = list(client.chat.completions.create(model="low", messages=MSGS, max_tokens=2, stream=True,  # type: ignore[arg-type]
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2 and chunks[-1].usage.total_tokens == 13

    r = client.chat.completions.create(model="low", messages=MSGS, tools=TOOLS, tool_choice="auto")  # type: ignore[arg-type]
    call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]

    streamed = list(client.chat.completions.create(model="low", messages=MSGS, tools=TOOLS, stream=True))  # type: ignore[arg-type]
    deltas = [c.choices[0].delta.tool_calls for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0][0].function.name == "get_weather"  # type: ignore[index,union-attr]

    r = client.chat.completions.create(model="low", messages=MSGS, response_format={"type": "json_object"})  # type: ignore[arg-type]
    assert json.loads(r.choices[0].message.content or "") == {"answer": 42}

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="tg-wrong-key-123456", max_retries=0).models.list()
    assert "tier-medium" in [m.id for m in client.models.list()]

    assert len(gw.ledger_rows()) == 6  # one row per upstream call


@pytest.mark.slow  # importing litellm alone takes ~4 s
def test_litellm_as_a_client(served: tuple[str, Gateway]) -> None:
    import litellm

    base, gw = served
    r = litellm.completion(model="openai/tier-low", api_base=base, api_key=gw.key, messages=MSGS, max_tokens=3)
    assert r.choices[0].message.content == "w0 w1 w2"  # type: ignore[union-attr]
    stream = litellm.completion(model="openai/tier-low", api_base=base, api_key=gw.key, messages=MSGS,
                                max_tokens=2, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)  # type: ignore[union-attr]
    assert text == "w0 w1"
    assert len(gw.ledger_rows()) == 2
