"""Identifiers are checked at the edge (gateway.ids): a NUL or another control character
in any id, file name, ``custom_id``, paging cursor or feedback ``request_id`` is a 400 in
OpenAI's shape naming the param — on SQLite and on PostgreSQL, where a NUL reaching the
database was a 500 with a traceback (PostgreSQL text cannot hold NUL)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from gateway.errors import InvalidRequest
from tests.gateway.edge.edge_support import ADMIN, edge_gateway, openai_error
from tests.gateway.gateway_harness import Gateway
from tests.gateway.jobs_support import create_batch, jsonl, line, upload
from tests.gateway.scripted_upstream import ScriptedUpstream

pytestmark = pytest.mark.usefixtures("admin_key")
CHAT = {"model": "low", "messages": [{"role": "user", "content": "hi"}]}
BAD = ["a\x00b", "\x00", "a\x01b", "a\x7fb", "a\nb", "a\x9bb"]

Case = Callable[[Gateway, str], Awaitable[Any]]


def _p(value: str) -> str:
    return quote(value, safe="")


async def _upload_named(gw: Gateway, bad: str) -> Any:
    # by hand: httpx would percent-encode the control characters of a file name
    body = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="in' + bad.encode() + b'.jsonl"\r\n'
            b"Content-Type: application/jsonl\r\n\r\n" + jsonl([line("q1", CHAT)]) + b"\r\n--b--\r\n")
    return await gw.client.post("/v1/files", content=body,
                                headers={**gw.auth, "content-type": "multipart/form-data; boundary=b"})


async def _custom_id(gw: Gateway, bad: str) -> Any:
    f = (await upload(gw.client, gw.auth, jsonl([line(f"q{bad}", CHAT)]))).json()
    return await create_batch(gw.client, gw.auth, f["id"])


async def _metadata_key(gw: Gateway, bad: str) -> Any:
    f = (await upload(gw.client, gw.auth, jsonl([line("q1", CHAT)]))).json()
    return await create_batch(gw.client, gw.auth, f["id"], metadata={f"k{bad}": "v"})


# (name, the param the 400 must name, the request)
CASES: list[tuple[str, str, Case]] = [
    ("file get", "file_id", lambda gw, b: gw.client.get(f"/v1/files/file-{_p(b)}", headers=gw.auth)),
    ("file content", "file_id", lambda gw, b: gw.client.get(f"/v1/files/file-{_p(b)}/content", headers=gw.auth)),
    ("file delete", "file_id", lambda gw, b: gw.client.delete(f"/v1/files/file-{_p(b)}", headers=gw.auth)),
    ("files after", "after", lambda gw, b: gw.client.get(f"/v1/files?after=file-{_p(b)}", headers=gw.auth)),
    ("files purpose", "purpose", lambda gw, b: gw.client.get(f"/v1/files?purpose=batch{_p(b)}", headers=gw.auth)),
    ("file name", "file", _upload_named),
    ("batch get", "batch_id", lambda gw, b: gw.client.get(f"/v1/batches/batch_{_p(b)}", headers=gw.auth)),
    ("batch cancel", "batch_id", lambda gw, b: gw.client.post(f"/v1/batches/batch_{_p(b)}/cancel", headers=gw.auth)),
    ("batches after", "after", lambda gw, b: gw.client.get(f"/v1/batches?after=batch_{_p(b)}", headers=gw.auth)),
    ("batch input file", "input_file_id", lambda gw, b: create_batch(gw.client, gw.auth, f"file-{b}")),
    ("custom_id", "custom_id", _custom_id),
    ("batch metadata key", "metadata", _metadata_key),
    ("feedback request_id", "request_id",
     lambda gw, b: gw.client.post("/v1/feedback", headers=gw.auth, json={"request_id": f"r{b}", "rating": "good"})),
    ("budget tenant get", "tenant_id", lambda gw, b: gw.client.get(f"/admin/budgets/tenants/t{_p(b)}", headers=ADMIN)),
    ("budget tenant put", "tenant_id",
     lambda gw, b: gw.client.put(f"/admin/budgets/tenants/t{_p(b)}", headers=ADMIN, json={"period": "day"})),
    ("budget key get", "key_id", lambda gw, b: gw.client.get(f"/admin/budgets/keys/k{_p(b)}", headers=ADMIN)),
    ("budget key put", "key_id",
     lambda gw, b: gw.client.put(f"/admin/budgets/keys/k{_p(b)}", headers=ADMIN, json={"period": "day"})),
    ("budget alerts", "tenant_id",
     lambda gw, b: gw.client.get(f"/admin/budgets/tenants/t{_p(b)}/alerts", headers=ADMIN)),
    ("dashboard tenant", "tenant_id", lambda gw, b: gw.client.get(f"/admin/api/tenants/t{_p(b)}", headers=ADMIN)),
    ("dashboard cursor", "before_id",
     lambda gw, b: gw.client.get(f"/admin/api/tenants/{gw.tenant_id}?before_at=2026-01-01T00:00:00%2B00:00"
                                 f"&before_id=r{_p(b)}", headers=ADMIN)),
    ("dashboard page", "tenant_id", lambda gw, b: gw.client.get(f"/admin/tenants/t{_p(b)}", headers=ADMIN)),
    ("key revoke", "key_id", lambda gw, b: gw.client.post(f"/admin/api/keys/k{_p(b)}/revoke", headers=ADMIN)),
]


def test_check_identifier() -> None:
    from gateway.ids import check_identifier
    assert check_identifier("file-abc_1.2", "file_id") == "file-abc_1.2"
    for bad in [*BAD, "", "x" * 257, "a\ud800"]:
        with pytest.raises(InvalidRequest) as info:
            check_identifier(bad, "file_id")
        assert info.value.param == "file_id" and info.value.status == 400


async def _every_case_is_400(gw: Gateway, bads: list[str]) -> None:
    failures = []
    for name, param, call in CASES:
        for bad in bads:
            r = await call(gw, bad)
            try:
                err = openai_error(r, 400)
                assert err["param"] == param and err["type"] == "invalid_request_error", err
            except AssertionError as exc:
                failures.append(f"{name} {bad!r}: {exc}")
    assert not failures, "\n".join(failures)
    # the gateway still works, and no traceback or 500 happened on the way
    r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=CHAT)
    assert r.status_code == 200


async def test_control_characters_in_ids_are_400_sqlite(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with edge_gateway(tmp_path, upstream) as gw:
        await _every_case_is_400(gw, BAD)


@pytest.mark.postgres
async def test_nul_in_ids_is_400_postgres(tmp_path: Path, upstream: ScriptedUpstream, postgres_url: str) -> None:
    async with edge_gateway(tmp_path, upstream, db_url=postgres_url) as gw:
        await _every_case_is_400(gw, ["a\x00b", "\x00", "a\x01b"])
        # well-formed ids still reach the database and answer 404
        assert openai_error(await gw.client.get("/v1/files/file-nope", headers=gw.auth), 404)
        assert openai_error(await gw.client.get("/v1/batches?after=batch_nope", headers=gw.auth), 404)
