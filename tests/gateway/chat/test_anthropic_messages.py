"""POST /v1/messages and /v1/messages/count_tokens through the real app (in process, SQLite, real
ledger and key store) against the scripted upstream: the allow-list, the translation both ways,
thinking budgets as effort, Anthropic's error shape, a stream failing mid-way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.chat.anthropic import effort_for_budget
from gateway.providers.metering import count_prompt_tokens
from tests.gateway.gateway_harness import Gateway, gateway
from tests.gateway.scripted_upstream import Behaviour, ScriptedUpstream

MSGS: list[Any] = [{"role": "user", "content": "say hi"}]


def events(raw: bytes) -> list[tuple[str, Any]]:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"event: "):
            name, _, data = block.partition(b"\ndata: ")
            out.append((name[7:].decode(), orjson.loads(data)))
    return out


def _key(gw: Gateway) -> dict[str, str]:
    return {"x-api-key": gw.key, "anthropic-version": "2023-06-01"}


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "low", "max_tokens": 5, "messages": MSGS, "frequency_penalty": 1}, "frequency_penalty"),
    ({"model": "low", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "citations": []}]}]}, "messages[0].content[0].citations"),
    ({"model": "low", "max_tokens": 5, "messages": MSGS, "mcp_servers": []}, "mcp_servers"),
])
async def test_unknown_fields_are_refused_in_anthropics_shape(tmp_path: Path, upstream: ScriptedUpstream,
                                                              body: dict[str, Any], param: str) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/messages", headers=_key(gw), json=body)
        assert r.status_code == 400
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert f"'{param}'" in err["error"]["message"] and "Anthropic Messages parameter" in err["error"]["message"]
        assert upstream.requests == []


@pytest.mark.parametrize(("body", "fragment"), [
    ({"model": "low", "messages": MSGS}, "'max_tokens'"),
    ({"model": "low", "max_tokens": 5, "messages": MSGS,
      "tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, "tools[0].type"),
    ({"model": "low", "max_tokens": 5, "messages": MSGS, "temperature": 1.5}, "'temperature'"),
    ({"model": "low", "max_tokens": 5, "messages": MSGS, "thinking": {"type": "enabled", "budget_tokens": 10}},
     "thinking.budget_tokens"),
    ({"model": "low", "max_tokens": "5", "messages": MSGS}, "'max_tokens'"),
])
async def test_invalid_values_are_400s(tmp_path: Path, upstream: ScriptedUpstream, body: dict[str, Any],
                                       fragment: str) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/messages", headers=_key(gw), json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and fragment in r.json()["error"]["message"]


async def test_missing_key_is_a_401_naming_both_headers(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/messages", json={"model": "low", "max_tokens": 5, "messages": MSGS})
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error" and "x-api-key" in r.json()["error"]["message"]
        r = await gw.client.post("/v1/messages/count_tokens", headers={"x-api-key": "tg-not-a-key-123456"},
                                 json={"model": "low", "messages": MSGS})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


async def test_blocks_are_translated_for_the_upstream(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    body = {"model": "low", "max_tokens": 5, "system": [{"type": "text", "text": "be ", "cache_control": {
        "type": "ephemeral"}}, {"type": "text", "text": "kind"}], "temperature": 0.5, "top_p": 0.9,
        "metadata": {"user_id": "u-1"}, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig"},
                                              {"type": "text", "text": "calling"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                          "content": [{"type": "text", "text": "boom"}]},
                                         {"type": "text", "text": "and now?"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/messages", headers=_key(gw), json=body)
        assert r.status_code == 200, r.text
        sent = upstream.requests[-1].body
        assert sent["messages"] == [
            {"role": "system", "content": "be kind"},
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]},
            {"role": "assistant", "content": "calling", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "[tool error] boom"},
            {"role": "user", "content": [{"type": "text", "text": "and now?"}]}]
        assert sent["tool_choice"] == "required" and sent["parallel_tool_calls"] is False
        assert sent["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        assert (sent["temperature"], sent["top_p"], sent["user"], sent["max_tokens"]) == (0.5, 0.9, "u-1", 5)
        msg = r.json()
        assert msg["stop_reason"] == "tool_use" and msg["content"][0] == {
            "type": "tool_use", "id": msg["content"][0]["id"], "name": "f", "input": {"city": "Paris"}}


@pytest.mark.parametrize(("budget", "tier"), [(1024, "low"), (4096, "medium"), (20000, "high"), (40000, "xhigh")])
def test_thinking_budget_maps_to_effort(budget: int, tier: str) -> None:
    assert effort_for_budget(budget) == tier


async def test_thinking_budget_routes_auto_and_usage_is_the_ledger_sum(tmp_path: Path,
                                                                       upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/messages", headers=_key(gw), json={
            "model": "auto", "max_tokens": 20, "messages": MSGS, "thinking": {"type": "enabled", "budget_tokens": 2000}})
        assert r.status_code == 200, r.text
        assert r.headers["x-tiergate-tier"] == "low" and r.headers["x-tiergate-effort-source"] == "client"
        # a deep budget: the high tier, run by the pipeline (several upstream calls, one answer)
        r = await gw.client.post("/v1/messages", headers=_key(gw), json={
            "model": "auto", "max_tokens": 200, "messages": MSGS, "stream": True,
            "thinking": {"type": "enabled", "budget_tokens": 20000}})
        assert r.status_code == 200, r.text
        assert r.headers["x-tiergate-tier"] == "high"
        evs = events(r.content)
        start, delta = evs[0][1], next(d for n, d in evs if n == "message_delta")
        rows = [row for row in gw.ledger_rows() if row.request_id == start["message"]["id"]]
        assert len(rows) > 1  # the pipeline's stage calls, each its own row
        assert delta["usage"]["input_tokens"] == sum(row.prompt_tokens for row in rows)
        assert delta["usage"]["output_tokens"] == sum(row.completion_tokens for row in rows)
        assert [n for n, _ in evs[:2]] == ["message_start", "ping"] and evs[-1][0] == "message_stop"
        (req,) = [q for q in gw.request_rows() if q.id == start["message"]["id"]]
        assert (req.status, req.http_status, req.pipeline) == ("ok", 200, True)


async def test_stream_failing_midway_ends_with_an_error_event(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    upstream.push(Behaviour(n_words=50, abort_after=3))
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/messages", headers=_key(gw), json={
            "model": "low", "max_tokens": 50, "messages": MSGS, "stream": True})
        assert r.status_code == 200
        evs = events(r.content)
        name, err = evs[-1]
        assert name == "error" and err["type"] == "error" and err["error"]["type"] == "api_error"
        assert "message_stop" not in [n for n, _ in evs]
        (req,) = gw.request_rows()
        assert (req.status, req.http_status) == ("error", 502)
        assert [row.status for row in gw.ledger_rows()] != []


async def test_count_tokens_uses_the_routed_models_tokenizer(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/messages/count_tokens", headers={"authorization": f"Bearer {gw.key}"},
                                 json={"model": "tier-low", "system": "be brief", "messages": MSGS})
        assert r.status_code == 200, r.text
        expected = count_prompt_tokens(gw.settings.models["up-a"], [{"role": "system", "content": "be brief"}, *MSGS])
        assert r.json() == {"input_tokens": expected}
        r = await gw.client.post("/v1/messages/count_tokens", headers=_key(gw),
                                 json={"model": "tier-low", "messages": MSGS, "max_tokens": 3})
        assert r.status_code == 400 and "'max_tokens'" in r.json()["error"]["message"]
        assert upstream.requests == [] and gw.ledger_rows() == []


async def test_an_unexpected_failure_is_a_500_in_anthropics_shape(tmp_path: Path, upstream: ScriptedUpstream,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    async with gateway(tmp_path, upstream) as gw:
        async def broken(*_: Any, **__: Any) -> Any:
            raise RuntimeError("secret detail from deep inside")

        monkeypatch.setattr(gw.app.state.tiergate.flow, "prepare", broken)
        r = await gw.client.post("/v1/messages", headers=_key(gw), json={"model": "low", "max_tokens": 5,
                                                                         "messages": MSGS})
        assert r.status_code == 500
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
        assert "secret detail" not in r.text


def test_stream_blocks_from_chunked_tool_calls() -> None:
    from gateway.chat.anthropic_reply import _Blocks

    blocks = _Blocks(thinking=False)
    raw = b"".join([
        *blocks.feed({"content": "let me look"}),
        *blocks.feed({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]}),
        *blocks.feed({"tool_calls": [{"index": 0, "id": "call_1", "function": {"arguments": '{"a":'}}]}),  # id repeated
        *blocks.feed({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        *blocks.feed({"tool_calls": [{"index": 1, "id": "call_2", "function": {"name": "g", "arguments": "{}"}}]}),
        *blocks.close()])
    evs = events(raw)
    starts = [d["content_block"] for n, d in evs if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use", "tool_use"]
    assert [(b["id"], b["name"]) for b in starts[1:]] == [("call_1", "f"), ("call_2", "g")]
    args = "".join(d["delta"]["partial_json"] for n, d in evs if n == "content_block_delta" and d["index"] == 1)
    assert args == '{"a":1}'
    assert [d["index"] for n, d in evs if n == "content_block_stop"] == [0, 1, 2]
