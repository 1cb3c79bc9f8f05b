"""A fast scripted fake OpenAI server for tests only (aiohttp.web on a loopback port, in its own
thread and event loop, so sync clients and async tests can both use it).

Default behaviour, deterministic so tests can check token sums:
- the reply is 8 words ``w0 w1 …`` (fewer when ``max_tokens`` is smaller), one word per stream
  chunk — or, on an upstream built with ``fill_max=True``, as many words as ``max_tokens`` allows
  up to ``fill_max_limit`` (the model's context: the adversary of budget holds, every call writes
  all it may); ``n`` choices of that many words each; usage: prompt_tokens = 10 +
  number of messages, completion_tokens = words × choices;
- tools present (tool_choice not "none") → one tool call to the first tool, args {"city": "Paris"};
- ``response_format`` json_object/json_schema → content ``{"answer": 42}``;
- streaming sends usage only when ``stream_options.include_usage`` is set.
Scripted behaviours (``push``) apply to the next requests in order: an HTTP error with an
optional retry-after, a timeout (hangs), a stream without usage, a slow stream (for client
disconnects; ``disconnects`` counts streams the gateway cut), a stream whose connection drops
after ``abort_after`` words (with ``burst``, the events before the drop arrive in one write
right before it, so the gateway has read none of them when the drop lands), a fixed reply
``content``, or a request that blocks until the gateway drops its connection (``cancelled``
counts those), before answering or (``stall_after``) after some stream events.
Every request is recorded (``requests``) with its path, headers and JSON body; ``wait_for``
waits, bounded, for a condition on them (from any thread).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict


@dataclass(frozen=True)
class Behaviour:
    status: int | None = None  # HTTP error status
    retry_after: str | None = None
    hang_s: float = 0.0  # sleep before answering (timeouts)
    omit_usage: bool = False
    chunk_delay_s: float = 0.0
    n_words: int | None = None
    abort_after: int | None = None  # drop the connection after this many words (mid-stream failure)
    burst: bool = False  # with abort_after: the chunks before the drop go out in one write, just before it
    content: str | None = None  # the reply's text instead of the words (usage still counts n words)
    block: bool = False  # never answer: wait until the gateway closes the connection
    stall_after: int | None = None  # stream: after this many events (0: just the headers), block as above
    hold_until_requests: int | None = None  # answer only once this many requests have arrived (10 s at most)
    hold_until: threading.Event | None = None  # answer only once the test sets this (10 s at most)


@dataclass
class Recorded:
    path: str
    headers: CIMultiDict[str]  # case-insensitive, as HTTP's are (httpx sends names lower-cased)
    body: dict[str, Any]


@dataclass
class ScriptedUpstream:
    host: str = "127.0.0.1"
    requests: list[Recorded] = field(default_factory=list)
    disconnects: int = 0
    completed_streams: int = 0
    cancelled: int = 0  # blocked requests whose connection the gateway closed
    answered: int = 0  # non-streamed 200 answers handed to the server to send
    fill_max: bool = False  # every reply is as long as max_tokens allows, for each of the n choices
    fill_max_limit: int = 4096  # fill_max: the longest reply (what the model's context allows)
    _script: deque[Behaviour] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> ScriptedUpstream:
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scripted-upstream", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("scripted upstream did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop_event.set)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        # handler_cancellation: a handler is cancelled when its client (the gateway) drops the connection
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        await self._stop_event.wait()
        await runner.cleanup()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def push(self, *behaviours: Behaviour) -> None:
        with self._lock:
            self._script.extend(behaviours)

    def clear(self) -> None:
        """Forget scripted behaviours no request has used."""
        with self._lock:
            self._script.clear()

    def _next(self) -> Behaviour:
        with self._lock:
            return self._script.popleft() if self._script else Behaviour()

    def wait_for(self, predicate: Callable[[ScriptedUpstream], bool], timeout_s: float = 10.0) -> bool:
        """Block until ``predicate(self)`` holds (checked whenever a request arrives or is
        cancelled); False if it still does not after ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout_s)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # ---------------------------------------------------------------- handler
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.requests.append(Recorded(request.path, CIMultiDict(request.headers), body))
        self._notify()
        b = self._next()
        if b.hold_until_requests is not None:
            n_held = b.hold_until_requests
            await asyncio.to_thread(self.wait_for, lambda up: len(up.requests) >= n_held)
        if b.hold_until is not None:
            await asyncio.to_thread(b.hold_until.wait, 10)
        if b.block:
            await self._until_dropped()
        if b.hang_s:
            await asyncio.sleep(b.hang_s)
        if b.status is not None:
            headers = {"Retry-After": b.retry_after} if b.retry_after is not None else {}
            err = {"error": {"message": f"scripted {b.status}", "type": "server_error", "param": None,
                             "code": None}}
            return web.Response(status=b.status, body=orjson.dumps(err), content_type="application/json",
                                headers=headers)
        cap = body.get("max_tokens") or body.get("max_completion_tokens")
        limit = self.fill_max_limit if self.fill_max else 8
        n = b.n_words or min(int(cap or limit), limit)
        choices = int(body.get("n") or 1)
        usage = {"prompt_tokens": 10 + len(body["messages"]), "completion_tokens": n * choices,
                 "total_tokens": 10 + len(body["messages"]) + n * choices,
                 "prompt_tokens_details": {"cached_tokens": 0},
                 "completion_tokens_details": {"reasoning_tokens": 0}}
        if body.get("stream"):
            return await self._stream(request, body, b, n, usage)
        message: dict[str, Any] = {"role": "assistant", "content": self._content(body, n, b)}
        finish = "stop"
        if self._tool_call(body):
            message = {"role": "assistant", "content": None, "tool_calls": [self._tool_call(body)]}
            finish = "tool_calls"
        resp = {"id": "chatcmpl-upstream", "object": "chat.completion", "created": int(time.time()),
                "model": body["model"], "choices": [{"index": i, "message": message, "finish_reason": finish,
                                                     "logprobs": None} for i in range(choices)]}
        if not b.omit_usage:
            resp["usage"] = usage
        response = web.Response(body=orjson.dumps(resp), content_type="application/json")
        self.answered += 1
        self._notify()
        return response

    async def _until_dropped(self) -> None:
        try:
            await asyncio.Event().wait()  # only the gateway closing the connection ends this
        except asyncio.CancelledError:
            self.cancelled += 1
            self._notify()
            raise

    @staticmethod
    def _content(body: dict[str, Any], n: int, b: Behaviour = Behaviour()) -> str:
        if b.content is not None:
            return b.content
        fmt = (body.get("response_format") or {}).get("type")
        if fmt in ("json_object", "json_schema"):
            return '{"answer": 42}'
        return " ".join(f"w{i}" for i in range(n))

    @staticmethod
    def _tool_call(body: dict[str, Any]) -> dict[str, Any] | None:
        if not body.get("tools") or body.get("tool_choice") == "none":
            return None
        name = body["tools"][0]["function"]["name"]
        return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": '{"city": "Paris"}'}}

    async def _stream(self, request: web.Request, body: dict[str, Any], b: Behaviour, n: int,
                      usage: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        base = {"id": "chatcmpl-upstream", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body["model"]}
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) and not b.omit_usage
        call = self._tool_call(body)

        held: list[bytes] = []  # burst: written together right before the drop

        sent = 0

        async def send(obj: dict[str, Any]) -> None:
            nonlocal sent
            if sent == b.stall_after:
                await self._until_dropped()
            sent += 1
            event = b"data: " + orjson.dumps(obj) + b"\n\n"
            if b.burst and b.abort_after is not None:
                held.append(event)
            else:
                await resp.write(event)

        try:
            await send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}]})
            if call:
                await send({**base, "choices": [{"index": 0, "delta": {"tool_calls": [{**call, "index": 0}]},
                                                 "finish_reason": None}]})
            else:
                words = self._content(body, n).split(" ")
                for i, word in enumerate(words):
                    for extra in range(1, int(body.get("n") or 1)):  # the other choices' words first
                        await send({**base, "choices": [{"index": extra, "delta": {"content": word if i == 0 else
                                                                                     " " + word},
                                                         "finish_reason": None}]})
                    if b.abort_after is not None and i == b.abort_after:
                        assert request.transport is not None
                        if held:  # these arrive with the drop: the gateway has read none of them yet
                            await resp.write(b"".join(held))
                        request.transport.abort()  # no [DONE], no usage: a broken stream
                        return resp
                    if b.chunk_delay_s:
                        await asyncio.sleep(b.chunk_delay_s)
                    await send({**base, "choices": [{"index": 0, "delta": {"content": word if i == 0 else " " + word},
                                                     "finish_reason": None}]})
            await send({**base, "choices": [{"index": 0, "delta": {},
                                             "finish_reason": "tool_calls" if call else "stop"}]})
            if include_usage:
                await send({**base, "choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.completed_streams += 1
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        return resp


UPSTREAM_KEY_ENV = "TIERGATE_TEST_UPSTREAM_KEY"
UPSTREAM_KEY = "sk-upstream-secret-0123456789"
ADMIN_KEY = "admin-secret-for-tests"  # TIERGATE_ADMIN_KEY in tests that use the admin API (conftest.admin_key)


def config_for(base_url: str, *, db_url: str = "sqlite:///var/tiergate.db", journal_dir: str = "var/journal",
               max_body_bytes: int = 1024 * 1024, context_window: int = 8192,
               max_retries: int = 2, durability: str = "process", timeout_s: float = 5,
               unknown_fields: str = "reject") -> dict[str, Any]:
    """A config.yaml dict whose every tier points at the scripted upstream (model ``up-a``, with
    ``up-b`` on the same server as the low tier's fallback). Exploration is off (the product's
    default explores 2% of ``auto`` requests, which would make a routed tier random in tests);
    the tests of exploration set ``routing.exploration`` themselves."""
    model = {"provider": "openai", "api_base": base_url, "api_key_env": UPSTREAM_KEY_ENV,
             "max_retries": max_retries, "timeout_s": timeout_s, "context_window": context_window,
             "price": {"input": 1.0, "output": 2.0}}
    tiers: dict[str, Any] = {t: {"model": "up-a"} for t in ("none", "minimal", "medium", "xhigh")}
    tiers["low"] = {"model": "up-a", "fallbacks": ["up-b"]}
    tiers["high"] = {"model": "up-high"}
    return {
        "server": {"max_body_bytes": max_body_bytes, "request_timeout_s": timeout_s,
                   "unknown_fields": unknown_fields},
        "database": {"url_env": "TIERGATE_TEST_UNSET_DB_URL", "default_url": db_url},
        "ledger": {"journal_dir": journal_dir, "flush_interval_ms": 5, "durability": durability},
        "models": {"up-a": {**model, "model": "upstream-a"}, "up-b": {**model, "model": "upstream-b"},
                   "up-high": {**model, "model": "upstream-high", "price": {"input": 10.0, "output": 20.0}},
                   "up-solo": {**model, "model": "upstream-solo"}},
        "tiers": tiers,
        "routing": {"exploration": 0.0},
    }
