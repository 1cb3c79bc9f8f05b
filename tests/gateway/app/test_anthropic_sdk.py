"""The official anthropic SDK, used unmodified as a client of a real tiergate (uvicorn on a loopback
port, SQLite, real ledger and key store) in front of the scripted OpenAI-style upstream: the
Messages API is translated into the same chat flow, and its usage is the ledger's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.gateway.gateway_harness import Gateway, served_gateway
from tests.gateway.scripted_upstream import UPSTREAM_KEY, UPSTREAM_KEY_ENV, ScriptedUpstream

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~2 s: eight SDK calls through uvicorn

MSGS: list[Any] = [{"role": "user", "content": "hello"}]
TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather in a city",
                     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Gateway]]:
    monkeypatch.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    with ScriptedUpstream() as up, served_gateway(tmp_path, up) as pair:
        yield pair


def _ledger_usage(gw: Gateway, request_id: str) -> tuple[int, int]:
    rows = [r for r in gw.ledger_rows() if r.request_id == request_id]
    assert rows, f"no ledger row for {request_id}"
    return sum(r.prompt_tokens for r in rows), sum(r.completion_tokens for r in rows)


def test_anthropic_sdk_unmodified(served: tuple[str, Gateway]) -> None:
    base, gw = served
    client = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=gw.key, max_retries=0)

    # plain
    r = client.messages.create(model="tier-low", max_tokens=3, messages=MSGS)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == "tier-low"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "w0 w1 w2"  # type: ignore[union-attr]
    assert r.stop_reason == "end_turn" and (r.usage.input_tokens, r.usage.output_tokens) == (11, 3)
    assert _ledger_usage(gw, r.id) == (11, 3)

    # system prompt (and Authorization: Bearer instead of x-api-key)
    bearer = anthropic.Anthropic(base_url=base.removesuffix("/v1"), auth_token=gw.key, max_retries=0)
    r = bearer.messages.create(model="low", max_tokens=2, system="be brief", messages=MSGS, stop_sequences=["."])
    sent = gw.upstream.requests[-1].body
    assert sent["messages"][0] == {"role": "system", "content": "be brief"} and sent["stop"] == ["."]
    assert r.usage.input_tokens == 12 and r.usage.output_tokens == 2

    # streaming: the text, and message_delta's usage equals the request's ledger rows
    events = list(client.messages.create(model="auto", max_tokens=4, messages=MSGS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]  # (the SDK skips pings)
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")  # type: ignore[union-attr]
    assert text == "w0 w1 w2 w3"
    start, delta = events[0], events[-2]
    assert start.type == "message_start" and delta.type == "message_delta"
    assert delta.delta.stop_reason == "end_turn"
    assert (delta.usage.input_tokens, delta.usage.output_tokens) == _ledger_usage(gw, start.message.id) == (11, 4)

    with client.messages.stream(model="tier-low", max_tokens=2, messages=MSGS) as stream:
        assert "".join(stream.text_stream) == "w0 w1"
        final = stream.get_final_message()
    assert final.usage.output_tokens == 2 and _ledger_usage(gw, final.id) == (final.usage.input_tokens, 2)

    # tool use, then the tool's result sent back
    r = client.messages.create(model="low", max_tokens=50, messages=MSGS, tools=TOOLS,
                               tool_choice={"type": "auto"})
    assert r.stop_reason == "tool_use"
    call = r.content[0]
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    follow: list[Any] = [*MSGS, {"role": "assistant", "content": r.content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                       "content": "sunny"}]}]
    r = client.messages.create(model="low", max_tokens=3, messages=follow)
    assert r.content[0].text == "w0 w1 w2"  # type: ignore[union-attr]
    sent_msgs = gw.upstream.requests[-1].body["messages"]
    assert sent_msgs[1]["tool_calls"][0]["id"] == call.id and sent_msgs[1]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert sent_msgs[2] == {"role": "tool", "tool_call_id": call.id, "content": "sunny"}

    with client.messages.stream(model="low", max_tokens=50, messages=MSGS, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}
    assert gw.upstream.requests[-1].body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}

    # count_tokens: no upstream call, no ledger row; the system prompt counts
    calls_before = len(gw.upstream.requests)
    plain = client.messages.count_tokens(model="tier-low", messages=MSGS)
    with_system = client.messages.count_tokens(model="tier-low", messages=MSGS, system="be brief and exact")
    assert 0 < plain.input_tokens < with_system.input_tokens
    assert len(gw.upstream.requests) == calls_before

    # a wrong key: 401 in Anthropic's error shape
    wrong = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key="tg-wrong-key-123456", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        wrong.messages.create(model="low", max_tokens=3, messages=MSGS)
    assert exc.value.status_code == 401
    assert exc.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "Invalid API key."}}
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="nope", max_tokens=3, messages=MSGS)
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]

    assert len(gw.ledger_rows()) == len(gw.upstream.requests) == 7  # one row per upstream call
