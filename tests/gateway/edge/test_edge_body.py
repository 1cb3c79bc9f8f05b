"""The one body reader (gateway.web.request_body) on every route: the key is checked before a byte of
the body is read (and the connection is then closed rather than drained), every route has a
size limit, a body that trickles in gets 408, JSON nested deeper than ``server.max_json_depth``
is a 400 that says so (orjson re-encodes at most 254 levels: deeper bodies were 500s), and the
error-shape details of batch create, multipart uploads and the alerts route."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.errors import InvalidRequest
from tests.gateway.edge.edge_support import (
    ADMIN,
    CountingBody,
    edge_gateway,
    nested,
    nested_json,
    openai_error,
)
from tests.gateway.jobs_support import create_batch, jsonl, line, upload, wait_final
from tests.gateway.scripted_upstream import ScriptedUpstream

pytestmark = pytest.mark.usefixtures("admin_key")
MSGS = [{"role": "user", "content": "hi"}]
CHAT = {"model": "low", "messages": MSGS}


def test_depth_walk_and_loads() -> None:
    from gateway.client_json import exceeds_depth, loads
    assert not exceeds_depth(nested(64), 64) and exceeds_depth(nested(65), 64)
    assert not exceeds_depth({"a": [{"b": 1}], "c": "[[[[["}, 3) and exceeds_depth({"a": [{"b": [1]}]}, 3)
    assert not exceeds_depth("scalar", 1)
    for depth in (65, 300, 1023, 1024, 5000):  # 1024+ is orjson's own parse limit: the same 400
        with pytest.raises(InvalidRequest) as info:
            loads(nested_json(depth), max_depth=64)
        assert info.value.code == "json_too_deep" and "64 levels" in info.value.message
    with pytest.raises(InvalidRequest) as info:
        loads(b"{nope", max_depth=64)
    assert info.value.code == "invalid_json"


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/batches"), ("PUT", "/admin/budgets/tenants/t1"), ("PUT", "/admin/budgets/keys/k1"),
    ("POST", "/v1/files"), ("POST", "/v1/feedback"), ("POST", "/v1/chat/completions"),
])
async def test_unauthenticated_body_is_never_read(tmp_path: Path, upstream: ScriptedUpstream,
                                                  method: str, path: str) -> None:
    async with edge_gateway(tmp_path, upstream) as gw:
        body = CountingBody(chunks=64)  # 4 MiB
        r = await gw.client.request(method, path, content=body, headers={"content-type": "application/json",
                                                                         "authorization": "Bearer tg-wrong-key-000"})
        openai_error(r, 401)
        assert body.pulled <= 1, f"{body.pulled} chunks read before the key was refused"
        assert r.headers.get("connection") == "close"  # the rest of the body is not drained on keep-alive


async def test_every_route_has_a_body_limit(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with edge_gateway(tmp_path, upstream, jobs={"max_file_bytes": 10_000}) as gw:
        padding = "x" * 70_000
        r = await gw.client.post("/v1/batches", headers=gw.auth, json={
            "input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h",
            "metadata": {"a": padding}})
        assert openai_error(r, 413)["code"] == "payload_too_large"
        r = await gw.client.put(f"/admin/budgets/tenants/{gw.tenant_id}", headers=ADMIN,
                                content=orjson.dumps({"period": "day", "pad": padding}))
        openai_error(r, 413)
        r = await gw.client.post("/v1/feedback", headers=gw.auth,
                                 json={"request_id": "x", "rating": "good", "prompt": "y" * (1 << 21)})
        openai_error(r, 413)

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length
            yield b'{"request_id": "x", "rating": "good", "prompt": "'
            for _ in range(40):
                yield b"y" * 65536
            yield b'"}'

        openai_error(await gw.client.post("/v1/feedback", headers=gw.auth, content=chunked()), 413)
        pulled = 0

        async def big_upload() -> AsyncIterator[bytes]:  # a 4 MiB chunked upload against a 10 kB limit
            nonlocal pulled
            yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
            for _ in range(64):
                pulled += 1
                yield b"y" * 65536
            yield b"\r\n--b--\r\n"

        r = await gw.client.post("/v1/files", content=big_upload(),
                                 headers={**gw.auth, "content-type": "multipart/form-data; boundary=b"})
        err = openai_error(r, 413)
        assert err["param"] == "file" and pulled < 64
        r = await upload(gw.client, gw.auth, b"z" * 10_001)
        assert openai_error(r, 413)["param"] == "file"


@pytest.mark.parametrize("depth", [65, 300, 1023, 2000])
async def test_deep_json_is_400_on_every_route(tmp_path: Path, upstream: ScriptedUpstream, depth: int) -> None:
    async with edge_gateway(tmp_path, upstream) as gw:
        raw = (b'{"model": "low", "messages": [{"role": "user", "content": "hi"}], "metadata": '
               + nested_json(depth) + b"}")
        for method, path, headers, content in [
            ("POST", "/v1/chat/completions", gw.auth, raw),
            ("POST", "/v1/batches", gw.auth, b'{"input_file_id": "f", "x": ' + nested_json(depth) + b"}"),
            ("POST", "/v1/feedback", gw.auth, b'{"request_id": "r", "messages": ' + nested_json(depth) + b"}"),
            ("PUT", f"/admin/budgets/tenants/{gw.tenant_id}", ADMIN,
             b'{"alert_thresholds": ' + nested_json(depth) + b"}"),
        ]:
            r = await gw.client.request(method, path, headers={**headers, "content-type": "application/json"},
                                        content=content)
            err = openai_error(r, 400)
            assert err["code"] == "json_too_deep" and "64 levels" in err["message"], (path, err)
        assert upstream.requests == []
        # the same limit inside a batch input file, refused when the batch is created
        deep_line = (b'{"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": '
                     + raw + b"}")
        f = (await upload(gw.client, gw.auth, jsonl([deep_line, line("q2", CHAT)]))).json()
        err = openai_error(await create_batch(gw.client, gw.auth, f["id"]), 400)
        assert err["code"] == "invalid_batch_line" and "64 levels" in err["message"]


async def test_json_at_the_depth_limit_is_served(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with edge_gateway(tmp_path, upstream, server={"max_json_depth": 40}) as gw:
        def with_tool(depth: int) -> dict[str, Any]:  # body, tools, tool, function, parameters: 5 levels
            return {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "x": nested(depth)}}}]}

        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=with_tool(35))
        assert r.status_code == 200, r.text
        err = openai_error(await gw.client.post("/v1/chat/completions", headers=gw.auth, json=with_tool(36)), 400)
        assert "40 levels" in err["message"]


async def test_a_body_that_trickles_in_gets_408(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with edge_gateway(tmp_path, upstream, server={"body_read_timeout_s": 0.3},
                            jobs={"upload_read_timeout_s": 0.3}) as gw:
        async def slow(first: bytes) -> AsyncIterator[bytes]:
            yield first
            await asyncio.sleep(2)
            yield b"}"

        for path, first in [("/v1/chat/completions", b'{"model": "low"'), ("/v1/batches", b'{"endpoint": "x"'),
                            ("/v1/feedback", b'{"request_id": "r"')]:
            r = await gw.client.post(path, headers=gw.auth, content=slow(first))
            err = openai_error(r, 408)
            assert err["code"] == "request_timeout" and r.headers.get("connection") == "close"
        r = await gw.client.post("/v1/files", content=slow(b"--b\r\n"),
                                 headers={**gw.auth, "content-type": "multipart/form-data; boundary=b"})
        assert openai_error(r, 408)["code"] == "request_timeout"


async def test_error_shape_details(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with edge_gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/batches", headers={**gw.auth, "content-type": "application/json"},
                                 content=b'{"input_file_id": ')
        err = openai_error(r, 400)
        assert err["code"] == "invalid_json" and err["param"] is None and "'1'" not in err["message"]
        # multipart errors carry a code and the param
        two_files = (b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\nx\r\n"
                     b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b\"\r\n\r\ny\r\n--b--\r\n")
        r = await gw.client.post("/v1/files", content=two_files,
                                 headers={**gw.auth, "content-type": "multipart/form-data; boundary=b"})
        err = openai_error(r, 400)
        assert err["code"] == "invalid_multipart" and err["param"] == "file"
        # an unknown tenant's alerts are 404 like its budget
        for path in ("/admin/budgets/tenants/ten_nope", "/admin/budgets/tenants/ten_nope/alerts"):
            assert openai_error(await gw.client.get(path, headers=ADMIN), 404)["code"] == "not_found"
        # batch metadata: OpenAI's 16 pairs, keys <= 64 characters, values <= 512
        f = (await upload(gw.client, gw.auth, jsonl([line("q1", CHAT)]))).json()
        for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"": "v"}):
            err = openai_error(await create_batch(gw.client, gw.auth, f["id"], metadata=metadata), 400)
            assert err["param"] == "metadata" and err["code"] == "invalid_value", err
        ok = {f"k{i:02d}" + "k" * 61: "v" * 512 for i in range(16)}
        r = await create_batch(gw.client, gw.auth, f["id"], metadata=ok)
        assert r.status_code == 200 and r.json()["metadata"] == ok
        await wait_final(gw.client, gw.auth, r.json()["id"])
        # a missing field names itself
        err = openai_error(await gw.client.post("/v1/batches", headers=gw.auth, json={"endpoint": "x"}), 400)
        assert err["param"] == "input_file_id" and err["code"] == "missing_required_parameter"
