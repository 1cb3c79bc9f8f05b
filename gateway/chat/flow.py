"""``ChatFlow``: one chat-completions request from its validated body to its answer and records,
independent of the web framework.

``prepare`` validates the body (the allow-list, gateway.schemas), reads whether the caller is past
a soft budget, makes the one ``RouteDecision`` (gateway.routing.decide: tier, model chain,
upstream body, plan) and checks the context window. ``complete`` and ``open_stream`` admit the
request (``Admission``: rate limits, the worst case held on the budgets, sized on the decision),
run it on the executor the decision names (direct or pipelined), settle the budgets to exactly
what its ledger rows cost, and record it. The answer is shaped the way OpenAI does: ``id`` is
the gateway's request id, ``model`` echoes what the client asked for, usage is always counted.
A stream is opened with its first chunk already received, so every refusal (budgets, limits, the
first upstream call's errors) is a JSON error, never an error event after a 200.

``complete`` and ``open_stream`` (until the first chunk) take an awaitable that ends when the
client disconnects: the work is then cancelled (upstream calls dropped, budgets settled) and the
request recorded as ``cancelled`` / 499, as a stream cut short is. Each request gets one
``RequestRecord``, durable at ``ledger.durability`` before the answer's last bytes leave.

Imports routing, schemas, the chat parts, ledger entries, providers and settings; no FastAPI.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import orjson

from gateway.chat.admission import Admission, Admitted, AdmittedStream
from gateway.chat.request import CallContext, ChatRequest, Executor
from gateway.chat.spend import Completion, RequestRows, Spend
from gateway.errors import ClientClosedRequest, GatewayError, InvalidRequest, ServiceUnavailable
from gateway.ids import fast_id
from gateway.ledger.entries import CallIntent, LedgerEntry, RequestRecord
from gateway.ledger.journal_writer import LedgerError
from gateway.log_safety import describe
from gateway.providers.base import CallOptions
from gateway.providers.metering import count_prompt_tokens
from gateway.routing import DecideAuto, RouteDecision, RoutingPrefs, decide
from gateway.schemas import parse_chat_request
from gateway.settings import Settings
from gateway.telemetry import tracing

if TYPE_CHECKING:
    from gateway.chat.sse import ChatStream

STATUS_CLIENT_CLOSED = ClientClosedRequest.status  # nginx's convention for "client went away"
PER_MESSAGE_OVERHEAD_TOKENS = 8
T = TypeVar("T")
log = logging.getLogger("tiergate.chat")


class PrincipalLike(Protocol):
    @property
    def tenant_id(self) -> str: ...
    @property
    def key_id(self) -> str | None: ...
    @property
    def allow_prompt_storage(self) -> bool: ...
    @property
    def routing(self) -> RoutingPrefs: ...


class DecisionSink(Protocol):
    """Where the classifier's routing decisions go to be learned from (gateway.learning.DecisionLog)."""

    def log(self, request_id: str, tenant_id: str, verdict: Any, messages: list[dict[str, Any]],
            allow_prompt_storage: bool) -> None: ...


class RequestLedger(Protocol):
    def record(self, entry: LedgerEntry) -> None: ...
    async def begin(self, intent: CallIntent) -> None: ...
    def record_request(self, rec: RequestRecord) -> None: ...
    async def wait_durable(self, level: Literal["process", "fsync", "none"] = ...) -> None: ...


@dataclass(frozen=True)
class ChatOutcome:
    """A finished non-streamed request: the answer, what it cost, how it was routed, and the
    budget headers (remaining after the settlement)."""

    response: dict[str, Any]
    spend: Spend
    decision: RouteDecision
    headers: dict[str, str]


def new_request_id() -> str:
    return "chatcmpl-" + fast_id()


def _chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) if isinstance(m.get("content"), str) else len(orjson.dumps(m))
               for m in messages)


def check_context_window(settings: Settings, model_name: str, messages: list[dict[str, Any]]) -> None:
    """400 ``context_length_exceeded`` (as OpenAI does) when the prompt cannot fit the model.

    Cheap first: a token is at least one character, so a prompt with fewer characters than the
    window always fits; only longer prompts are counted with the tokenizer."""
    model = settings.models[model_name]
    if _chars(messages) + PER_MESSAGE_OVERHEAD_TOKENS * len(messages) <= model.context_window:
        return
    tokens = count_prompt_tokens(model, messages)
    if tokens > model.context_window:
        raise InvalidRequest(f"This model's maximum context length is {model.context_window} tokens. "
                             f"However, your messages resulted in {tokens} tokens.",
                             param="messages", code="context_length_exceeded")


class ChatFlow:
    """``rate_limited``: per-minute limits apply (live requests; batch lines are throttled by
    ``jobs.concurrency`` instead). ``park_rows``: a direct request's call row is journaled with its
    request record in one write (live requests); batch lines journal each row as its call ends."""

    def __init__(self, settings: Settings, *, direct: Executor, pipelined: Executor, admission: Admission,
                 ledger: RequestLedger, decide_auto: DecideAuto | None = None, rate_limited: bool = True,
                 park_rows: bool = True, decisions: DecisionSink | None = None) -> None:
        self.settings, self.direct, self.pipelined, self.admission = settings, direct, pipelined, admission
        self.ledger, self.decide_auto, self.decisions = ledger, decide_auto, decisions
        self.rate_limited, self.park_rows = rate_limited, park_rows

    async def prepare(self, principal: PrincipalLike, data: Any, *, request_id: str | None = None
                      ) -> tuple[ChatRequest, bool]:
        """The request, decided, and whether it asked to be streamed."""
        wire = parse_chat_request(data, self.settings.server.unknown_fields)
        body = wire.forwardable()  # re-encoded from the validated model: never the raw body
        soft = await self.admission.soft_exceeded(principal)
        decision = decide(self.settings, wire.model, body, reasoning_effort=wire.reasoning_effort,
                          decide_auto=self.decide_auto, soft_budget_exceeded=soft, tenant=principal.tenant_id,
                          prefs=principal.routing)
        check_context_window(self.settings, decision.models[0], body["messages"])
        tier = self.settings.tiers.get(decision.tier)  # type: ignore[call-overload]
        asked = wire.tiergate.speculative_mode if wire.tiergate is not None else None
        options = CallOptions(experts_per_token=tier.engine.experts_per_token if tier else None,
                              timeout_s=self.settings.server.request_timeout_s,
                              speculative=asked or (tier.engine.speculative if tier else None),
                              cache_salt=principal.tenant_id)
        req = ChatRequest(request_id=request_id or new_request_id(), tenant_id=principal.tenant_id,
                          key_id=principal.key_id, decision=decision, options=options,
                          include_usage=wire.include_usage, allow_prompt_storage=principal.allow_prompt_storage)
        tracing.annotate_request(decision, body["messages"])
        if decision.verdict is not None and self.decisions is not None:  # routed by the classifier: learnable
            self.decisions.log(req.request_id, req.tenant_id, decision.verdict, body["messages"],
                               principal.allow_prompt_storage)
        return req, wire.stream

    def _executor(self, req: ChatRequest) -> Executor:
        return self.pipelined if req.decision.uses_pipeline else self.direct

    def _rows(self, req: ChatRequest) -> RequestRows:
        return RequestRows(self.ledger, park=self.park_rows and not req.decision.uses_pipeline)

    async def finish(self, req: ChatRequest, rows: RequestRows, status: str, http_status: int,
                     error_code: str | None = None) -> None:
        """Record the request (and its parked call rows, in the same journal batch), then wait
        until both are as durable as ``ledger.durability`` says."""
        parked = rows.take_parked()
        d, spend = req.decision, rows.spend
        try:
            record = RequestRecord(
                id=req.request_id, tenant_id=req.tenant_id, key_id=req.key_id, requested_model=d.requested_model,
                status=status, tier=d.tier, effort_source=d.effort_source, classifier_score=d.classifier_score,
                classifier_version=d.classifier_version, pipeline=d.uses_pipeline, http_status=http_status,
                error_code=error_code, latency_ms=round((time.perf_counter() - req.started) * 1000, 3),
                prompt_tokens=spend.usage.prompt_tokens, completion_tokens=spend.usage.completion_tokens,
                cost_nanos=spend.cost_nanos, baseline_cost_nanos=spend.baseline_nanos)
        finally:
            for entry in parked:  # back to back with the request record: one journal batch, one fsync
                self.ledger.record(entry)
        self.ledger.record_request(record)
        tracing.annotate_outcome(record)
        level = self.settings.ledger.durability
        if level != "none":  # this record and every call row before it: written (process) / fsync'd
            try:
                await self.ledger.wait_durable(level)
            except LedgerError as exc:  # the journal cannot take them now: they stay queued, retried
                raise ServiceUnavailable("The gateway could not record this request's spend durably (its "
                                         "ledger journal is not writable); it is retried in the background.",
                                         retry_after_s=5) from exc

    async def finish_failed(self, req: ChatRequest, rows: RequestRows, status: str, http_status: int,
                             code: str | None) -> None:
        """``finish`` for a request that failed: the client gets the original error even when the
        journal cannot take the record right now (the record stays queued and is retried; the
        journal writer logs and reports the failure)."""
        try:
            await self.finish(req, rows, status, http_status, code)
        except ServiceUnavailable:
            log.warning("request %s: its %s record waits for the ledger journal", req.request_id, status)

    async def _recorded_on_failure(self, req: ChatRequest, rows: RequestRows,
                                   run: Callable[[], Awaitable[T]]) -> T:
        """``run()``; if it fails, record the request as an error before re-raising."""
        try:
            return await run()
        except GatewayError as err:
            status = "cancelled" if isinstance(err, ClientClosedRequest) else "error"
            await self.finish_failed(req, rows, status, err.status, err.code)
            raise
        except Exception:
            await self.finish_failed(req, rows, "error", 500, "internal_error")
            raise
        except BaseException:  # cancelled (shutdown): no answer to send, but the calls are billed
            for entry in rows.take_parked():
                self.ledger.record(entry)
            raise

    async def _run(self, rows: RequestRows, req: ChatRequest) -> tuple[Completion, Admitted]:
        admitted = await self.admission.admit(req, rate_limited=self.rate_limited)
        try:
            completion = await self._executor(req).complete(req, CallContext(rows, admitted))
        finally:
            await admitted.close(rows.spend)  # exactly the request's ledger rows, whatever happened
        return completion, admitted

    async def complete(self, req: ChatRequest, client_gone: Awaitable[object] | None = None) -> ChatOutcome:
        """The answer. ``client_gone``: ends when the client disconnects (raises
        ``ClientClosedRequest`` then, after the cancelled work has billed what it spent)."""
        rows = self._rows(req)
        run = unless_gone(functools.partial(self._run, rows, req), client_gone)
        completion, admitted = await self._recorded_on_failure(req, rows, run)
        response = completion.response
        response["id"] = req.request_id
        response["model"] = req.decision.requested_model
        if not response.get("usage"):
            response["usage"] = rows.spend.usage.to_openai()
        await self.finish(req, rows, "ok", 200)
        tracing.annotate_completion(response)
        return ChatOutcome(response, rows.spend, req.decision, admitted.headers)

    async def _open(self, rows: RequestRows, req: ChatRequest) -> tuple[AdmittedStream, dict[str, Any] | None]:
        admitted = await self.admission.admit(req, rate_limited=self.rate_limited)
        try:
            inner = await self._executor(req).stream(req, CallContext(rows, admitted))
        except BaseException:
            await admitted.close(rows.spend)
            raise
        stream = AdmittedStream(inner, admitted, lambda: rows.spend)
        try:  # primed: whatever refuses the request does so before the response's status line
            return stream, await stream.__anext__()
        except StopAsyncIteration:
            return stream, None

    async def open_stream(self, req: ChatRequest, client_gone: Awaitable[object] | None = None) -> ChatStream:
        """Open the stream; errors before its first chunk raise (a JSON error response).
        ``client_gone`` as for ``complete``: a client that leaves before the first chunk cancels
        the wait (``ClientClosedRequest``); after it, the response's own disconnect watch does."""
        from gateway.chat.sse import ChatStream

        rows = self._rows(req)
        run = unless_gone(functools.partial(self._open, rows, req), client_gone)
        stream, first = await self._recorded_on_failure(req, rows, run)
        return ChatStream(self, req, rows, stream, first)


# -- racing the work against the client's disconnect ---------------------------------------------
def unless_gone(run: Callable[[], Awaitable[T]],
                client_gone: Awaitable[object] | None) -> Callable[[], Awaitable[T]]:
    """``run``, cancelled once if ``client_gone`` ends first (then ``ClientClosedRequest``)."""
    if client_gone is None:
        return run
    return functools.partial(_run_unless_gone, run, client_gone)


async def _run_unless_gone(run: Callable[[], Awaitable[T]], client_gone: Awaitable[object]) -> T:
    """The work runs in this task. If it is still running after ``WATCH_CLIENT_AFTER_S``, a watcher
    task starts waiting on ``client_gone``; if the client has left, the watcher cancels this task
    once — a plain ``Task.cancel`` (not a cancel scope), so the work's own cleanup (cancelled calls'
    ledger rows, shielded budget settlements) runs to its end — and the cancel surfaces as
    ``ClientClosedRequest``. Quick answers never start the watcher, and nothing runs as a second
    task on the hot path: a watcher per request cost ~0.1 ms of added p50 in ``tiergate bench
    gateway``, the work as its own task ~0.15 ms."""
    me = asyncio.current_task()
    assert me is not None
    watch: asyncio.Future[object] | None = None
    watching = True  # a done-callback already scheduled when the work ends must not cancel what follows

    def left(done: asyncio.Future[object]) -> None:
        if watching and not done.cancelled() and done.exception() is None:
            me.cancel(_CLIENT_GONE)

    def start_watching() -> None:
        nonlocal watch
        watch = asyncio.ensure_future(client_gone)
        watch.add_done_callback(left)

    timer = asyncio.get_running_loop().call_later(WATCH_CLIENT_AFTER_S, start_watching)
    try:
        return await run()
    except asyncio.CancelledError:
        client_left = watch is not None and watch.done() and not watch.cancelled() and watch.exception() is None
        if client_left and me.cancelling() == 1:  # only the watcher's cancel: not a shutdown
            me.uncancel()
            raise ClientClosedRequest("the client closed the connection before the answer was ready") from None
        raise
    finally:
        watching = False
        timer.cancel()
        if watch is None:
            if inspect.iscoroutine(client_gone):
                client_gone.close()  # never started
        else:
            watch.remove_done_callback(left)
            watch.cancel()
            failed = watch.exception() if watch.done() and not watch.cancelled() else None
            if failed is not None:
                log.warning("watching the client connection failed: %s", describe(failed))


WATCH_CLIENT_AFTER_S = 0.05
_CLIENT_GONE = "tiergate: the client disconnected"
