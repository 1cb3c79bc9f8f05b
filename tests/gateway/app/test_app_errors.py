"""Every error in OpenAI's shape with the right status; /v1/models, /healthz, /readyz."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.gateway_harness import gateway
from tests.gateway.scripted_upstream import ScriptedUpstream

MSGS = [{"role": "user", "content": "hi"}]


def openai_error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer tg-not-a-real-key-000000"},
                                     {"Authorization": "Basic abc"}, {"Authorization": "Bearer "}])
async def test_401_for_missing_or_bad_keys(tmp_path: Path, upstream: ScriptedUpstream,
                                           headers: dict[str, str]) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=headers, json={"model": "low", "messages": MSGS})
        err = openai_error(r, 401)
        assert err["code"] == "invalid_api_key"
        r = await gw.client.get("/v1/models", headers=headers)
        openai_error(r, 401)
    assert upstream.requests == []


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "low"}, "messages"),
    ({"messages": MSGS}, "model"),
    ({"model": "low", "messages": []}, "messages"),
    ({"model": "low", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "low", "messages": MSGS, "temperature": 7}, "temperature"),
    ({"model": "low", "messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ({"model": "low", "messages": MSGS, "stream": "yes please"}, "stream"),
    ({"model": "low", "messages": MSGS, "reasoning_effort": "ultra"}, "reasoning_effort"),
    ({"model": "low", "messages": MSGS, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
])
async def test_400_with_param(tmp_path: Path, upstream: ScriptedUpstream, body: dict[str, Any], param: str) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=body)
        err = openai_error(r, 400)
        assert err["param"] == param and err["type"] == "invalid_request_error"
    assert upstream.requests == []


async def test_400_for_invalid_json_and_non_object(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        for content in (b"{not json", b"[1, 2]", b""):
            r = await gw.client.post("/v1/chat/completions", headers={**gw.auth, "content-type": "application/json"},
                                     content=content)
            openai_error(r, 400)


UNKNOWN = {"model": "low", "messages": [{"role": "user", "content": "x", "future_field": 1}],
           "some_new_option": {"a": 1}}


async def test_unknown_fields_are_refused_naming_them(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=UNKNOWN)
        err = openai_error(r, 400)
        assert (err["param"], err["code"]) == ("some_new_option", "unsupported_parameter")
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={**UNKNOWN, "some_new_option": None})
        assert openai_error(r, 400)["param"] == "some_new_option"  # null too: the name is unknown
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={k: v for k, v in UNKNOWN.items() if k != "some_new_option"})
        assert openai_error(r, 400)["param"] == "messages[0].future_field"
    assert upstream.requests == []


async def test_unknown_fields_dropped_when_configured(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream, unknown_fields="drop") as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=UNKNOWN)
        assert r.status_code == 200, r.text
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={**UNKNOWN, "temperature": "0.5"})
        assert openai_error(r, 400)["param"] == "temperature"  # dropping never loosens the known fields
    (sent,) = [req.body for req in upstream.requests]
    assert "some_new_option" not in sent and sent["messages"] == [{"role": "user", "content": "x"}]


async def test_404_unknown_model_and_route(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={"model": "gpt-9", "messages": MSGS})
        err = openai_error(r, 404)
        assert (err["code"], err["param"]) == ("model_not_found", "model")
        openai_error(await gw.client.get("/v1/nothing-here", headers=gw.auth), 404)
        openai_error(await gw.client.get("/v1/models/gpt-9", headers=gw.auth), 404)
        openai_error(await gw.client.get("/v1/chat/completions", headers=gw.auth), 405)


async def test_413_by_content_length_and_by_streamed_size(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream, max_body_bytes=2000) as gw:
        big = {"model": "low", "messages": [{"role": "user", "content": "x" * 5000}]}
        err = openai_error(await gw.client.post("/v1/chat/completions", headers=gw.auth, json=big), 413)
        assert err["code"] == "payload_too_large"

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked upload
            yield b'{"model": "low", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}]}'

        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, content=chunks())
        openai_error(r, 413)
    assert upstream.requests == []


async def test_prompt_longer_than_context_window_is_400(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream, context_window=64) as gw:
        long = {"model": "low", "messages": [{"role": "user", "content": "hello world " * 200}]}
        err = openai_error(await gw.client.post("/v1/chat/completions", headers=gw.auth, json=long), 400)
        assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
        short = {"model": "low", "messages": [{"role": "user", "content": "hello " * 20}]}
        assert (await gw.client.post("/v1/chat/completions", headers=gw.auth, json=short)).status_code == 200
    assert len(upstream.requests) == 1


async def test_models_listing(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.get("/v1/models", headers=gw.auth)
        ids = [m["id"] for m in r.json()["data"]]
        assert ids[0] == "auto" and "tier-low" in ids and "tier-xhigh" in ids and "up-solo" in ids
        r = await gw.client.get("/v1/models/tier-low", headers=gw.auth)
        assert r.json() == {"id": "tier-low", "object": "model", "created": 0, "owned_by": "tiergate"}


async def test_health_and_readiness(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        assert (await gw.client.get("/healthz")).json() == {"status": "ok"}
        r = await gw.client.get("/readyz")
        assert r.status_code == 200
        assert r.json() == {"status": "ok", "database": True, "ledger": True,
                            "ledger_state": {"pending_db": 0, "open_intents": 0, "owners_to_settle": 0,
                                             "interrupted_settled": 0}}
        gw.session_factory.kw["bind"].dispose()
        (Path(tmp_path) / "tiergate.db").unlink()
        (Path(tmp_path) / "tiergate.db").mkdir()  # the database file is gone and cannot be recreated
        r = await gw.client.get("/readyz")  # degraded: still serving, the spend goes to the journal
        assert r.status_code == 200 and r.json()["database"] is False and r.json()["status"] == "degraded"
