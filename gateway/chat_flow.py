"""One chat-completions request from validated body to answer, independent of the web framework.

``ChatFlow.prepare`` validates the body, resolves ``model`` to a tier/model chain (with the
``auto`` hook), checks the context window and builds the upstream body. ``complete`` and
``stream`` run it through the ``Executor`` and shape the answer the way OpenAI does: ``id`` is
the gateway's request id, ``model`` echoes what the client asked for, usage is always counted
(asked upstream even when the client did not ask, and stripped from what the client sees).
``complete`` and ``open_stream`` (until the first chunk) can be given an awaitable that ends when
the client disconnects: the work is then cancelled (the upstream calls are dropped, budgets
settled) and the request recorded as ``cancelled`` / 499, as a stream cut short is.
Each request gets one ``RequestRecord``, durable at ``ledger.durability`` (by default: written to
the journal, so it survives kill -9) before the answer's last bytes leave.

Imports schemas, resolve, execution, ledger entries, providers and settings; no FastAPI.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal, Protocol, TypeVar

import orjson

from gateway.errors import ClientClosedRequest, GatewayError, InvalidRequest
from gateway.execution import Executor, ResolvedRequest
from gateway.ids import fast_id
from gateway.ledger.entries import LedgerEntry, RequestRecord
from gateway.log_safety import describe
from gateway.providers.base import CallOptions
from gateway.providers.metering import count_prompt_tokens
from gateway.resolve import DecideAuto, cap_output, output_cap, resolve_model
from gateway.schemas import ChatCompletionRequest, parse_chat_request
from gateway.settings import Settings

STATUS_CLIENT_CLOSED = ClientClosedRequest.status  # nginx's convention for "client went away"
PER_MESSAGE_OVERHEAD_TOKENS = 8
T = TypeVar("T")

log = logging.getLogger("tiergate.chat")


class PrincipalLike(Protocol):
    @property
    def tenant_id(self) -> str: ...
    @property
    def key_id(self) -> str: ...
    @property
    def allow_prompt_storage(self) -> bool: ...


class RequestLedger(Protocol):
    def record(self, entry: LedgerEntry) -> None: ...
    def record_request(self, rec: RequestRecord) -> None: ...
    async def wait_durable(self, level: Literal["process", "fsync", "none"] = ...) -> None: ...


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
    def __init__(self, settings: Settings, executor: Executor, ledger: RequestLedger, *,
                 decide_auto: DecideAuto | None = None, default_tier: str = "low") -> None:
        self.settings, self.executor, self.ledger = settings, executor, ledger
        self.decide_auto = decide_auto
        self.default_tier = default_tier

    def prepare(self, principal: PrincipalLike, data: Any) -> tuple[ResolvedRequest, ChatCompletionRequest]:
        req = parse_chat_request(data, self.settings.server.unknown_fields)
        body = req.forwardable()  # re-encoded from the validated model: never the raw body
        messages: list[dict[str, Any]] = body["messages"]
        resolution = resolve_model(self.settings, req.model, messages, reasoning_effort=req.reasoning_effort,
                                   decide_auto=self.decide_auto, default_tier=self.default_tier)
        check_context_window(self.settings, resolution.models[0], messages)
        cap_output(body, output_cap(self.settings, resolution))
        tier = self.settings.tiers.get(resolution.tier)  # type: ignore[call-overload]
        options = CallOptions(experts_per_token=tier.engine.experts_per_token if tier else None,
                              timeout_s=self.settings.server.request_timeout_s)
        rr = ResolvedRequest(request_id=new_request_id(), tenant_id=principal.tenant_id,
                             key_id=principal.key_id, resolution=resolution, body=body,
                             options=options, allow_prompt_storage=principal.allow_prompt_storage)
        rr.tally.deferred = []  # call rows join the request record in one journal batch (finish)
        return rr, req

    def record_deferred(self, rr: ResolvedRequest) -> None:
        """Hand the request's parked call rows to the ledger (idempotent; never drops a row)."""
        for entry in rr.tally.take_deferred():
            self.ledger.record(entry)

    async def finish(self, rr: ResolvedRequest, status: str, http_status: int,
                     error_code: str | None = None) -> None:
        rows = rr.tally.take_deferred()  # parked call rows: their tokens are in the tally already
        t, r = rr.tally, rr.resolution
        try:
            record = RequestRecord(
                id=rr.request_id, tenant_id=rr.tenant_id, key_id=rr.key_id, requested_model=r.requested_model,
                status=status, tier=t.effort or r.tier, effort_source=t.effort_source or r.effort_source,
                classifier_score=r.classifier_score,
                classifier_version=r.classifier_version, pipeline=t.pipeline, http_status=http_status,
                error_code=error_code, latency_ms=round((time.perf_counter() - rr.started) * 1000, 3),
                prompt_tokens=t.usage.prompt_tokens, completion_tokens=t.usage.completion_tokens,
                cost_nanos=t.cost_nanos, baseline_cost_nanos=t.baseline_cost_nanos)
        finally:
            for entry in rows:  # back to back with the request record: one journal batch, one fsync
                self.ledger.record(entry)
        self.ledger.record_request(record)
        level = self.settings.ledger.durability
        if level != "none":  # this record and every call row before it: written (process) / fsync'd
            await self.ledger.wait_durable(level)

    async def _recorded_on_failure(self, rr: ResolvedRequest,
                                   run: Callable[[ResolvedRequest], Awaitable[T]]) -> T:
        """``run(rr)``; if it fails, record the request as an error before re-raising."""
        try:
            return await run(rr)
        except GatewayError as err:
            status = "cancelled" if isinstance(err, ClientClosedRequest) else "error"
            await self.finish(rr, status, err.status, err.code)
            raise
        except Exception:
            await self.finish(rr, "error", 500, "internal_error")
            raise
        except BaseException:  # cancelled (shutdown): no answer to send, but the calls are billed
            self.record_deferred(rr)
            raise

    async def complete(self, rr: ResolvedRequest, client_gone: Awaitable[object] | None = None) -> dict[str, Any]:
        """The answer. ``client_gone``: ends when the client disconnects (raises
        ``ClientClosedRequest`` then, after the cancelled work has billed what it spent)."""
        response = await self._recorded_on_failure(rr, _unless_gone(self.executor.complete, client_gone))
        response["id"] = rr.request_id
        response["model"] = rr.resolution.requested_model
        if not response.get("usage"):
            response["usage"] = rr.tally.usage.to_openai()
        await self.finish(rr, "ok", 200)
        return response

    async def open_stream(self, rr: ResolvedRequest, include_usage: bool,
                          client_gone: Awaitable[object] | None = None) -> ChatStream:
        """Open the upstream stream; errors before the first chunk raise (JSON error response).
        ``client_gone`` as for ``complete``: a client that leaves before the first chunk cancels
        the wait (``ClientClosedRequest``); after it, the response's own disconnect watch does."""
        chunks = await self._recorded_on_failure(rr, _unless_gone(self._primed_stream, client_gone))
        return ChatStream(self, rr, chunks, include_usage)

    async def _primed_stream(self, rr: ResolvedRequest) -> AsyncIterator[dict[str, Any]]:
        """The executor's stream with its first chunk already received, so that everything that can
        refuse the request (budgets, rate limits, the first upstream call's errors) does so before
        the response's status line: a 429 is a JSON 429, never an error event after a 200."""
        chunks = await self.executor.stream(rr)
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            return chunks
        except BaseException:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()
            raise
        return PrimedStream(first, chunks)


def _unless_gone(run: Callable[[ResolvedRequest], Awaitable[T]],
                 client_gone: Awaitable[object] | None) -> Callable[[ResolvedRequest], Awaitable[T]]:
    """``run``, cancelled once if ``client_gone`` ends first (then ``ClientClosedRequest``)."""
    if client_gone is None:
        return run
    return functools.partial(_run_unless_gone, run, client_gone)


async def _run_unless_gone(run: Callable[[ResolvedRequest], Awaitable[T]], client_gone: Awaitable[object],
                           rr: ResolvedRequest) -> T:
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
        return await run(rr)
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


class PrimedStream:
    """A chunk stream whose first chunk was received ahead (``ChatFlow._primed_stream``)."""

    def __init__(self, first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]) -> None:
        self._first: dict[str, Any] | None = first
        self._rest = rest

    def __aiter__(self) -> PrimedStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._rest.__anext__()

    async def aclose(self) -> None:
        aclose = getattr(self._rest, "aclose", None)
        if aclose is not None:
            await aclose()


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class ChatStream:
    """The SSE bytes of one streamed answer. ``close()`` must run however the response ends:
    when the client went away it cancels the upstream, bills what was generated and records
    the request as cancelled."""

    def __init__(self, flow: ChatFlow, rr: ResolvedRequest, chunks: AsyncIterator[dict[str, Any]],
                 include_usage: bool) -> None:
        self.flow, self.rr, self.chunks, self.include_usage = flow, rr, chunks, include_usage
        self.finished = False
        self._created = int(time.time())

    async def __aiter__(self) -> AsyncIterator[bytes]:
        rr, model = self.rr, self.rr.resolution.requested_model
        try:
            async for chunk in self.chunks:
                if chunk.get("usage") and not chunk.get("choices"):
                    continue  # the upstream's usage chunk: replaced by ours below
                if self.include_usage:
                    chunk["usage"] = None
                else:
                    chunk.pop("usage", None)
                chunk["id"], chunk["model"] = rr.request_id, model
                self._created = chunk.get("created") or self._created
                yield _sse(chunk)
        except GatewayError as err:  # mid-stream upstream failure: OpenAI sends an error event
            self.finished = True
            await self.flow.finish(rr, "error", err.status, err.code)
            yield _sse(err.body())
            return
        if self.include_usage:
            yield _sse({"id": rr.request_id, "object": "chat.completion.chunk", "created": self._created,
                        "model": model, "choices": [], "usage": rr.tally.usage.to_openai()})
        self.finished = True
        await self.flow.finish(rr, "ok", 200)
        yield b"data: [DONE]\n\n"

    async def close(self) -> None:
        try:
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()  # no-op when the stream already ended; else cancels + bills
        finally:
            if not self.finished:
                self.finished = True
                await self.flow.finish(self.rr, "cancelled", STATUS_CLIENT_CLOSED, "client_closed_request")
            else:
                self.flow.record_deferred(self.rr)  # nothing is parked after finish; never drop one
