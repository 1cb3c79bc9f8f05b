"""A client that hangs up on ``POST /v1/chat/completions`` while the upstream call is in flight —
non-streaming, streaming before the first chunk, streaming between chunks — through a real
uvicorn server: the upstream sees its connection closed (its handler is cancelled), pipeline
stages not yet started never start, the budget holds are released (nothing left held until
lease expiry), and the ledger has the calls' rows plus a ``cancelled`` / 499 /
``client_closed_request`` request record whose cost is what the budget was charged.

The upstream timeout is two minutes and every wait is bounded at 10 s, so only the disconnect
(not a timeout) can cancel the upstream call in time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.ledger import RequestRecord
from gateway.money import nanos_to_decimal
from gateway.providers.metering import count_text_tokens
from gateway.web import hangup, serving
from tests.gateway.gateway_harness import Gateway, served_gateway
from tests.gateway.scripted_models import plan_json
from tests.gateway.scripted_upstream import ADMIN_KEY, Behaviour, ScriptedUpstream

ADMIN = ADMIN_KEY
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("admin_key")]
WAIT_S = 10.0
UPSTREAM_TIMEOUT_S = 120.0
MESSAGES = [{"role": "user", "content": "Compute 17*23 and then add 5."}]



def final_records(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> tuple[list[RequestRecord], threading.Event]:
    """The request records the gateway hands its ledger, and an event set on the first final one."""
    seen: list[RequestRecord] = []
    done = threading.Event()
    record_request = gw.ledger.record_request

    def observed(rec: RequestRecord) -> None:
        record_request(rec)
        seen.append(rec)
        if rec.status != "in_progress":
            done.set()

    monkeypatch.setattr(gw.ledger, "record_request", observed)
    return seen, done


async def hang_up_when(base: str, gw: Gateway, body: dict[str, Any],
                       ready: Callable[[ScriptedUpstream], bool], received: bytes = b"") -> None:
    """Send the chat request on a raw connection, wait until ``ready(upstream)`` and until the
    answer so far contains ``received``, then close it."""
    url = httpx.URL(base)
    assert url.host and url.port
    reader, writer = await asyncio.open_connection(url.host, url.port)
    raw = orjson.dumps(body)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: tiergate\r\n"
                 b"Authorization: Bearer " + gw.key.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    await writer.drain()
    try:
        assert await asyncio.to_thread(gw.upstream.wait_for, ready, WAIT_S), "the upstream call never started"
        answer = b""
        while received not in answer:
            more = await asyncio.wait_for(reader.read(65536), WAIT_S)
            assert more, f"the answer ended before {received!r}: {answer!r}"
            answer += more
    finally:
        writer.close()
        await writer.wait_closed()


def admin_url(gw: Gateway) -> str:
    root = str(gw.client.base_url).removesuffix("/").removesuffix("/v1")  # the client's base is .../v1
    return f"{root}/admin/budgets/tenants/{gw.tenant_id}"


async def set_budget(gw: Gateway) -> None:
    r = await gw.client.put(admin_url(gw), headers={"Authorization": f"Bearer {ADMIN}"},
                            json={"period": "day", "limit_usd": "10"})
    assert r.status_code == 200, r.text


async def budget_status(gw: Gateway) -> dict[str, Any]:
    r = await gw.client.get(admin_url(gw), headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return r.json()["status"]  # type: ignore[no-any-return]


def assert_cancelled_record(records: list[RequestRecord], cost: Decimal) -> RequestRecord:
    (final,) = [r for r in records if r.status != "in_progress"]
    assert (final.status, final.http_status, final.error_code) == ("cancelled", 499, "client_closed_request")
    assert nanos_to_decimal(final.cost_nanos) == cost  # exact: the request record sums its rows
    return final


def _protocol(name: str, monkeypatch: pytest.MonkeyPatch, hangups: list[int]) -> Any:
    """``uvicorn``: uvicorn's own httptools protocol, the disconnect seen through ``receive()``;
    ``tiergate-serve``: the protocol `tiergate serve` runs, which reports the lost connection to
    the request from ``connection_lost`` (gateway.web.hangup); ``hangups`` gets the number of
    hooks each report ran."""
    if name == "uvicorn":
        return "auto"
    real_hang_up = serving.hang_up

    def counted(scope: Any) -> None:
        hangups.append(len(scope.get(hangup.HANGUP_KEY) or ()))
        real_hang_up(scope)

    monkeypatch.setattr(serving, "hang_up", counted)
    return serving.HeaderTimeoutHttpTools


@pytest.mark.parametrize("protocol", ["uvicorn", "tiergate-serve"])
async def test_direct_call_is_cancelled_when_the_client_hangs_up(
        tmp_path: Path, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch, protocol: str) -> None:
    hangups: list[int] = []
    http = _protocol(protocol, monkeypatch, hangups)
    upstream.push(Behaviour(block=True))
    with served_gateway(tmp_path, upstream, http=http, timeout_s=UPSTREAM_TIMEOUT_S) as (base, gw):
        async with gw.client:
            await set_budget(gw)
            records, recorded = final_records(gw, monkeypatch)
            body = {"model": "low", "messages": MESSAGES, "max_tokens": 50}
            await hang_up_when(base, gw, body, lambda up: len(up.requests) == 1)

            assert await asyncio.to_thread(upstream.wait_for, lambda up: up.cancelled == 1, WAIT_S), \
                "the upstream call was not cancelled"
            assert await asyncio.to_thread(recorded.wait, WAIT_S), "no final request record"
            final = assert_cancelled_record(records, Decimal(0))
            (row,) = gw.ledger_rows()
            assert (row.request_id, row.stage, row.status) == (final.id, "direct", "cancelled")
            assert row.prompt_tokens == row.completion_tokens == 0 and row.cost_usd == 0
            (stored,) = gw.request_rows()
            assert (stored.id, stored.status, stored.http_status) == (final.id, "cancelled", 499)
            status = await budget_status(gw)
            assert status["held_usd"] == 0 and status["spent_usd"] == 0
            assert len(upstream.requests) == 1  # no retry, no fallback after the hang-up
            assert hangups == ([1] if protocol == "tiergate-serve" else [])  # the request's hook ran


async def test_pipeline_stops_and_bills_its_finished_stages_when_the_client_hangs_up(
        tmp_path: Path, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch) -> None:
    # plan answers (and reports its tokens); step s1 blocks; s2 (after s1) and review never start
    upstream.fill_max = True  # each call writes all max_tokens allow: the plan row bills that
    plan = plan_json(("s1", "multiply", []), ("s2", "add five", ["s1"]))
    upstream.push(Behaviour(content=plan), Behaviour(block=True))
    with served_gateway(tmp_path, upstream, timeout_s=UPSTREAM_TIMEOUT_S) as (base, gw):
        async with gw.client:
            await set_budget(gw)
            records, recorded = final_records(gw, monkeypatch)
            body = {"model": "auto", "reasoning_effort": "high", "messages": MESSAGES}
            await hang_up_when(base, gw, body, lambda up: len(up.requests) == 2)

            assert await asyncio.to_thread(upstream.wait_for, lambda up: up.cancelled == 1, WAIT_S), \
                "the running stage's upstream call was not cancelled"
            assert await asyncio.to_thread(recorded.wait, WAIT_S), "no final request record"
            rows = gw.ledger_rows()
            assert [(r.stage, r.status) for r in rows] == [("plan", "ok"), ("execute", "cancelled")]
            plan_row, step_row = rows
            sent = upstream.requests[0].body  # the scripted upstream reports 10 + messages, max_tokens
            assert plan_row.prompt_tokens == 10 + len(sent["messages"])
            assert plan_row.completion_tokens == sent["max_tokens"] and plan_row.cost_usd > 0
            assert step_row.prompt_tokens == step_row.completion_tokens == 0 and step_row.cost_usd == 0
            final = assert_cancelled_record(records, plan_row.cost_usd)
            assert final.pipeline and final.prompt_tokens == plan_row.prompt_tokens
            assert {r.request_id for r in rows} == {final.id}
            status = await budget_status(gw)
            assert status["held_usd"] == 0
            assert Decimal(str(status["spent_usd"])) == plan_row.cost_usd
            assert len(upstream.requests) == 2  # the stages after the hang-up never started


@pytest.mark.parametrize("waiting", [Behaviour(block=True), Behaviour(stall_after=0)],
                         ids=["no-response-yet", "headers-but-no-chunk"])
async def test_stream_is_cancelled_when_the_client_hangs_up_before_the_first_chunk(
        tmp_path: Path, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch, waiting: Behaviour) -> None:
    upstream.push(waiting)
    with served_gateway(tmp_path, upstream, timeout_s=UPSTREAM_TIMEOUT_S) as (base, gw):
        async with gw.client:
            await set_budget(gw)
            records, recorded = final_records(gw, monkeypatch)
            body = {"model": "low", "messages": MESSAGES, "max_tokens": 50, "stream": True}
            await hang_up_when(base, gw, body, lambda up: len(up.requests) == 1)

            assert await asyncio.to_thread(upstream.wait_for, lambda up: up.cancelled == 1, WAIT_S), \
                "the upstream call was not cancelled"
            assert await asyncio.to_thread(recorded.wait, WAIT_S), "no final request record"
            (row,) = gw.ledger_rows()
            assert (row.stage, row.status, row.completion_tokens) == ("direct", "cancelled", 0)
            final = assert_cancelled_record(records, row.cost_usd)
            assert row.request_id == final.id and final.prompt_tokens == row.prompt_tokens
            (stored,) = gw.request_rows()
            assert (stored.id, stored.status, stored.http_status) == (final.id, "cancelled", 499)
            status = await budget_status(gw)
            assert status["held_usd"] == 0
            assert Decimal(str(status["spent_usd"])) == row.cost_usd
            assert len(upstream.requests) == 1  # no retry, no fallback after the hang-up


@pytest.mark.parametrize("protocol", ["uvicorn", "tiergate-serve"])
async def test_stream_waiting_between_chunks_is_cancelled_when_the_client_hangs_up(
        tmp_path: Path, upstream: ScriptedUpstream, monkeypatch: pytest.MonkeyPatch, protocol: str) -> None:
    """(see ``_protocol``) Under `tiergate serve`'s protocol two hooks run: the stream opening's
    (its wait for the first chunk is over) and the response's, which cancels the stream."""
    hangups: list[int] = []
    http = _protocol(protocol, monkeypatch, hangups)
    upstream.push(Behaviour(stall_after=2))  # the role chunk and "w0", then nothing until dropped
    with served_gateway(tmp_path, upstream, http=http, timeout_s=UPSTREAM_TIMEOUT_S) as (base, gw):
        async with gw.client:
            await set_budget(gw)
            records, recorded = final_records(gw, monkeypatch)
            body = {"model": "low", "messages": MESSAGES, "max_tokens": 50, "stream": True}
            await hang_up_when(base, gw, body, lambda up: len(up.requests) == 1, received=b'"content":"w0"')

            assert await asyncio.to_thread(upstream.wait_for, lambda up: up.cancelled == 1, WAIT_S), \
                "the upstream call was not cancelled"
            assert await asyncio.to_thread(recorded.wait, WAIT_S), "no final request record"
            (row,) = gw.ledger_rows()
            assert (row.stage, row.status) == ("direct", "cancelled")
            assert row.completion_tokens == count_text_tokens(gw.settings.models["up-a"], "w0")  # what was sent
            final = assert_cancelled_record(records, row.cost_usd)
            assert row.request_id == final.id
            status = await budget_status(gw)
            assert status["held_usd"] == 0
            assert Decimal(str(status["spent_usd"])) == row.cost_usd
            assert len(upstream.requests) == 1
            assert hangups == ([2] if protocol == "tiergate-serve" else [])  # the stream's hooks ran
