"""POST /v1/chat/completions through the real app (SQLite, real ledger and key store) against
the scripted upstream: wire shape, model echo, resolution, SSE, usage handling, ledger rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.providers.base import CALL_ID_HEADER
from gateway.providers.metering import count_prompt_tokens, count_text_tokens
from tests.gateway.gateway_harness import gateway
from tests.gateway.scripted_upstream import UPSTREAM_KEY, Behaviour, ScriptedUpstream

MSGS = [{"role": "user", "content": "say hi"}]


def sse_events(raw: bytes) -> list[Any]:
    events = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


async def test_non_streaming_shape_model_echo_and_ledger(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "tier-medium", "messages": MSGS, "max_tokens": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("chatcmpl-") and body["id"] == r.headers["x-request-id"]
        assert body["model"] == "tier-medium"
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "w0 w1 w2"}
        assert body["usage"]["prompt_tokens"] == 11 and body["usage"]["completion_tokens"] == 3
        (row,) = gw.ledger_rows()
        assert (row.request_id, row.tenant_id, row.stage, row.tier, row.model, row.status) == (
            body["id"], gw.tenant_id, "direct", "medium", "up-a", "ok")
        assert (row.prompt_tokens, row.completion_tokens) == (11, 3)
        assert float(row.cost_usd) == pytest.approx((11 * 1.0 + 3 * 2.0) / 1e6)
        assert float(row.baseline_cost_usd) == pytest.approx((11 * 10.0 + 3 * 20.0) / 1e6)
        (req,) = gw.request_rows()
        assert (req.id, req.status, req.http_status, req.tier, req.effort_source) == (
            body["id"], "ok", 200, "medium", "client")


@pytest.mark.parametrize(("model", "tier", "upstream_model"), [
    ("low", "low", "upstream-a"), ("tier-high", "high", "upstream-high"),
    ("up-solo", "direct", "upstream-solo"), ("up-high", "high", "upstream-high"),
    ("auto", "low", "upstream-a"),
])
async def test_model_resolution(tmp_path: Path, upstream: ScriptedUpstream, model: str, tier: str,
                                upstream_model: str) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={"model": model, "messages": MSGS})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.headers["x-tiergate-tier"] == tier
        assert upstream.requests[-1].body["model"] == upstream_model
        (row,) = gw.ledger_rows()
        assert row.tier == tier


async def test_auto_with_reasoning_effort_uses_that_tier(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "auto", "messages": MSGS, "reasoning_effort": "high"})
        assert r.headers["x-tiergate-tier"] == "high"
        (req,) = gw.request_rows()
        assert req.effort_source == "client"


async def test_stream_strips_usage_the_client_did_not_ask_for(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "low", "messages": MSGS, "stream": True, "max_tokens": 4})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.content)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all("usage" not in c for c in chunks)
        assert {c["id"] for c in chunks} == {r.headers["x-request-id"]}
        assert {c["model"] for c in chunks} == {"low"}
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "w0 w1 w2 w3"
        assert upstream.requests[-1].body["stream_options"] == {"include_usage": True}
        (row,) = gw.ledger_rows()
        assert (row.prompt_tokens, row.completion_tokens, row.status) == (11, 4, "ok")


async def test_stream_include_usage(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
            "model": "low", "messages": MSGS, "stream": True, "max_tokens": 2,
            "stream_options": {"include_usage": True}})
        events = sse_events(r.content)
        usage_chunk = events[-2]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 2
        assert usage_chunk["usage"]["total_tokens"] == 13
        assert all(c["usage"] is None for c in events[:-2])


async def test_stream_without_upstream_usage_is_counted_and_billed(tmp_path: Path,
                                                                   upstream: ScriptedUpstream) -> None:
    upstream.push(Behaviour(omit_usage=True, n_words=6))
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
            "model": "low", "messages": MSGS, "stream": True, "stream_options": {"include_usage": True}})
        usage = sse_events(r.content)[-2]["usage"]
        assert usage["completion_tokens"] >= 6 and usage["prompt_tokens"] > 0
        (row,) = gw.ledger_rows()
        assert row.completion_tokens == usage["completion_tokens"]


async def test_fallback_rows_one_per_upstream_call(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    upstream.push(Behaviour(status=500), Behaviour(status=500), Behaviour(status=500))
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={"model": "low", "messages": MSGS})
        assert r.status_code == 200
        rows = gw.ledger_rows()
        assert sorted((x.model, x.status) for x in rows) == [("up-a", "error")] * 3 + [("up-b", "ok")]
        assert sum(x.completion_tokens for x in rows) == 8
        # Each call carries its own row's id upstream (provider logs and the ledger reconcile by it).
        sent = [req.headers.get(CALL_ID_HEADER) for req in upstream.requests]
        assert sorted(sent) == sorted(x.id for x in rows) and len(set(sent)) == 4  # type: ignore[type-var]


async def test_upstream_failure_is_502_and_recorded(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    upstream.push(*[Behaviour(status=503)] * 3)
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "medium", "messages": MSGS})
        assert r.status_code == 502
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and UPSTREAM_KEY not in r.text
        rows = gw.ledger_rows()
        assert [x.status for x in rows] == ["error"] * 3
        (req,) = gw.request_rows()
        assert (req.status, req.http_status) == ("error", 502)


async def test_tools_and_json_mode_forwarded(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
            "model": "low", "messages": MSGS, "tools": tools, "tool_choice": "auto"})
        call = r.json()["choices"][0]["message"]["tool_calls"][0]
        assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
        assert upstream.requests[-1].body["tools"] == tools
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
            "model": "low", "messages": MSGS, "response_format": {"type": "json_object"}})
        assert orjson.loads(r.json()["choices"][0]["message"]["content"]) == {"answer": 42}


@pytest.mark.parametrize("durability", ["process", "fsync", "none"])
async def test_responses_wait_for_the_journal_at_the_configured_level(
        tmp_path: Path, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch, durability: str) -> None:
    async with gateway(tmp_path, upstream, durability=durability) as gw:
        waits: list[str] = []
        real_wait = gw.ledger.wait_durable

        async def counting_wait(level: str) -> None:
            waits.append(level)
            await real_wait(level)

        monkeypatch.setattr(gw.ledger, "wait_durable", counting_wait)
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={"model": "low", "messages": MSGS})
        assert r.status_code == 200
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "low", "messages": MSGS, "stream": True})
        assert sse_events(r.content)[-1] == "[DONE]"
        assert waits == ([] if durability == "none" else [durability] * 2)
        assert len(gw.ledger_rows()) == 2  # recorded either way


@pytest.mark.parametrize("burst", [False, True], ids=["chunk-by-chunk", "burst-then-drop"])
async def test_upstream_failing_mid_stream_sends_an_error_event_and_bills(tmp_path: Path, upstream: ScriptedUpstream,
                                                                         burst: bool) -> None:
    # burst: the six words arrive in one write together with the dropped connection, so aiohttp
    # holds them unread when it stores the connection error; they must still all be delivered
    upstream.push(Behaviour(n_words=50, abort_after=6, burst=burst))
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
            "model": "low", "messages": MSGS, "stream": True, "stream_options": {"include_usage": True}})
        events = sse_events(r.content)
        assert "[DONE]" not in events
        assert set(events[-1]) == {"error"} and events[-1]["error"]["code"] == "upstream_error"
        chunks = events[:-1]  # the role chunk, then one per word: each exactly once, no usage chunk
        assert [e["choices"][0]["delta"].get("content") for e in chunks] == ["", "w0", *(f" w{i}" for i in range(1, 6))]
        text = "".join(e["choices"][0]["delta"]["content"] for e in chunks)
        model = gw.settings.models["up-a"]
        sent = upstream.requests[0].body["messages"]
        (row,) = gw.ledger_rows()  # billed: exactly what the client received, counted once
        assert row.status == "error"
        assert (row.prompt_tokens, row.completion_tokens) == (count_prompt_tokens(model, sent),
                                                              count_text_tokens(model, text))
        assert float(row.cost_usd) == pytest.approx((row.prompt_tokens * 1.0 + row.completion_tokens * 2.0) / 1e6)
        (req,) = gw.request_rows()
        assert (req.status, req.http_status) == ("error", 502)
        assert (req.prompt_tokens, req.completion_tokens, req.cost_usd) == (
            row.prompt_tokens, row.completion_tokens, row.cost_usd)
        assert len(upstream.requests) == 1  # no retry after the first chunk


async def test_call_rows_and_request_record_share_one_journal_fsync(tmp_path: Path, upstream: ScriptedUpstream,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.ledger.journal import Journal

    batches: list[int] = []
    real_write = Journal.write_lines  # one write per group; its fdatasync follows (or is awaited) per group

    def counting_write(self: Journal, lines: bytes) -> Any:
        batches.append(lines.count(b"\n"))  # one line per record (JSON escapes newlines)
        return real_write(self, lines)

    monkeypatch.setattr(Journal, "write_lines", counting_write)
    import sys

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the journal thread takes the GIL as eagerly as it can (as under serve)
    n = 20
    try:
        async with gateway(tmp_path, upstream) as gw:
            for i in range(n):
                r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                         json={"model": "low", "messages": MSGS, "stream": i % 2 == 1})
                assert r.status_code == 200
            assert len(gw.ledger_rows()) == n and len(gw.request_rows()) == n
    finally:
        sys.setswitchinterval(old_interval)
    # per request: its call's intent (written alone, before the call), then the call's row and the
    # request record together
    assert sum(batches) == 3 * n
    assert len(batches) <= n * 2.25  # ~one write for the intent + one for the row and record, not one per row
