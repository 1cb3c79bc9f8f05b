"""``ChatFlow.complete`` with ``client_gone``: the executor's work is cancelled exactly once, so
its cleanup (several awaits, as a budget settlement makes) runs to its end before the request is
recorded as cancelled/499; work that finishes first stands; a shutdown still cancels the work
and keeps its rows. In-memory ledger, an executor scripted with events (no sleeps)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from gateway.budgets import build_budget_runtime
from gateway.chat.admission import Admission
from gateway.chat.flow import ChatFlow
from gateway.chat.request import CallContext, ChatRequest
from gateway.chat.spend import Completion, Spend
from gateway.errors import ClientClosedRequest
from gateway.ids import fast_id
from gateway.ledger import LedgerEntry, RequestRecord
from gateway.ledger.entries import CallIntent
from gateway.providers.base import Usage
from gateway.routing import NO_PREFS, RoutingPrefs
from gateway.settings import settings_from_dict
from tests.gateway.scripted_upstream import config_for

ANSWER = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                                    "finish_reason": "stop"}]}


@dataclass
class ListLedger:
    entries: list[LedgerEntry] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)

    def record(self, entry: LedgerEntry) -> None:
        self.entries.append(entry)

    async def begin(self, intent: CallIntent) -> None:
        return None

    def record_request(self, rec: RequestRecord) -> None:
        self.records.append(rec)

    async def wait_durable(self, level: Literal["process", "fsync", "none"] = "process") -> None:
        return None


@dataclass(frozen=True)
class Principal:
    tenant_id: str = "t1"
    key_id: str = "k1"
    allow_prompt_storage: bool = False
    routing: RoutingPrefs = NO_PREFS


class BlockingExecutor:
    """Blocks until cancelled (or ``answer`` is set); on cancel records a cancelled row (the flow
    parks it until the request record), then cleans up over several awaits, as a shielded budget
    settlement does."""

    def __init__(self) -> None:
        self.started, self.answer, self.cleaned_up = asyncio.Event(), asyncio.Event(), False

    async def complete(self, req: ChatRequest, calls: CallContext) -> Completion:
        self.started.set()
        try:
            await self.answer.wait()
            return Completion(dict(ANSWER), Spend())
        except asyncio.CancelledError:
            calls.sink.record(LedgerEntry(
                id=fast_id(), request_id=req.request_id, tenant_id=req.tenant_id, key_id=req.key_id,
                stage="direct", tier="low", model="up-a", usage=Usage(), cost_nanos=0, baseline_cost_nanos=0,
                status="cancelled"))
            for _ in range(3):
                await asyncio.sleep(0)  # a second cancel would land here and cut the cleanup short
            self.cleaned_up = True
            raise

    async def stream(self, req: ChatRequest, calls: CallContext) -> Any:
        raise NotImplementedError


async def flow_and_request(executor: BlockingExecutor) -> tuple[ChatFlow, ListLedger, ChatRequest]:
    settings = settings_from_dict(config_for("http://127.0.0.1:9/v1"))
    ledger = ListLedger()
    budgets = build_budget_runtime(settings, None)  # no policies: admission holds nothing
    flow = ChatFlow(settings, direct=executor, pipelined=executor, admission=Admission(settings, budgets.budgets),
                    ledger=ledger)
    req, _ = await flow.prepare(Principal(), {"model": "low", "messages": [{"role": "user", "content": "hi"}]})
    return flow, ledger, req


async def test_client_gone_cancels_the_work_once_and_records_it_cancelled() -> None:
    executor = BlockingExecutor()
    flow, ledger, rr = await flow_and_request(executor)
    gone = asyncio.Event()
    task = asyncio.ensure_future(flow.complete(rr, client_gone=gone.wait()))
    await executor.started.wait()
    gone.set()
    with pytest.raises(ClientClosedRequest):
        await task
    assert executor.cleaned_up
    (row,) = ledger.entries
    (rec,) = ledger.records
    assert row.status == "cancelled" and row.request_id == rec.id == rr.request_id
    assert (rec.status, rec.http_status, rec.error_code) == ("cancelled", 499, "client_closed_request")


async def test_work_that_finishes_first_stands_and_stops_watching_the_client() -> None:
    executor = BlockingExecutor()
    flow, ledger, rr = await flow_and_request(executor)
    watching = asyncio.Event()
    watch_cancelled = asyncio.Event()

    async def client_gone() -> None:
        watching.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            watch_cancelled.set()
            raise

    task = asyncio.ensure_future(flow.complete(rr, client_gone=client_gone()))
    await asyncio.wait_for(asyncio.gather(executor.started.wait(), watching.wait()), 10)
    executor.answer.set()
    response = (await asyncio.wait_for(task, 10)).response
    assert response["id"] == rr.request_id and response["choices"] == ANSWER["choices"]
    await asyncio.wait_for(watch_cancelled.wait(), 10)
    assert [r.status for r in ledger.records] == ["ok"] and not executor.cleaned_up


async def test_shutdown_cancels_the_work_and_keeps_its_rows() -> None:
    executor = BlockingExecutor()
    flow, ledger, rr = await flow_and_request(executor)
    task = asyncio.ensure_future(flow.complete(rr, client_gone=asyncio.Event().wait()))
    await executor.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert executor.cleaned_up
    assert [e.status for e in ledger.entries] == ["cancelled"]  # billed; no answer, so no request record
    assert ledger.records == []
