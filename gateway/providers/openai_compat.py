"""The lean OpenAI-compatible upstream client (OpenAI, vLLM, SGLang, tiergate's engine server).

One pooled ``aiohttp.ClientSession`` per process (built on first use inside the running loop,
closed by ``aclose``), orjson in and out, connect/read timeouts, and true streaming: SSE lines
are parsed as they arrive and the upstream connection is closed as soon as the consumer stops
iterating (client disconnect), so the upstream stops generating; while a stream is open its
connection is also in ``HANGUP_CLOSERS`` (when the HTTP layer set it), so a client's hang-up
reported in the server's callback drops it at once. When the upstream connection
breaks mid-stream, every complete line it had already delivered is still handed over (and so
billed) before the error. The URL and key come only from ``ModelSettings`` (config.yaml), never
from the request body.

Imports aiohttp, orjson, settings, errors and providers.base only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any

import aiohttp
import orjson

from gateway.errors import GatewayError, InvalidRequest, UpstreamError, UpstreamTimeout
from gateway.providers.base import CALL_ID_HEADER, HANGUP_CLOSERS, CallOptions
from gateway.providers.payload import EXTENSION_PARAMS, SPECS
from gateway.settings import ModelSettings

SessionFactory = Callable[[], aiohttp.ClientSession]
_RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 529})


def default_session_factory() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0, ttl_dns_cache=300,
                                     enable_cleanup_closed=True)
    return aiohttp.ClientSession(connector=connector, json_serialize=lambda o: orjson.dumps(o).decode(),
                                 auto_decompress=True, trust_env=False)


def _headers(model: ModelSettings, options: CallOptions) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    headers.update(options.trace_headers)  # traceparent (tracing on): the upstream continues the trace
    if options.call_id is not None:  # the ledger row's id: provider logs and the ledger reconcile by it
        headers[CALL_ID_HEADER] = options.call_id
    key = model.api_key()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _scrub(text: str, model: ModelSettings) -> str:
    key = model.api_key()
    if key:
        text = text.replace(key, "***")
    return text[:500]


def upstream_http_error(status: int, raw: bytes, model: ModelSettings,
                        retry_after: str | None) -> GatewayError:
    """Map an upstream HTTP error to the gateway's tree without leaking its secrets."""
    detail = ""
    try:
        err = orjson.loads(raw).get("error") or {}
        detail = _scrub(str(err.get("message") or ""), model) if isinstance(err, dict) else ""
    except (orjson.JSONDecodeError, AttributeError):
        pass
    if status in (400, 422):
        return InvalidRequest(f"upstream rejected the request: {detail or 'bad request'}",
                              code="upstream_bad_request")
    headers = {"retry-after": retry_after} if retry_after else None
    if status in _RETRYABLE_STATUS:
        return UpstreamError(f"upstream returned HTTP {status}", upstream_status=status,
                             retryable=True, headers=headers)
    # 401/403/404 from the upstream are configuration problems, not the client's: don't retry
    # the same model, but the router may still fall back to the next one.
    return UpstreamError(f"upstream returned HTTP {status}", upstream_status=status, retryable=False)


async def _lines(content: aiohttp.StreamReader) -> AsyncGenerator[bytes, None]:
    """The body's lines as they arrive. When the connection breaks (reset, cut mid-body, read
    timeout), aiohttp's readers raise the stored error ahead of the bytes it had already
    received; those complete lines are handed over first, then the error is raised."""
    while True:
        try:
            line = await content.readline()
        except (aiohttp.ClientError, TimeoutError):
            for received in _received_lines(content):
                yield received
            raise
        if not line:
            return
        yield line


def _received_lines(content: aiohttp.StreamReader) -> list[bytes]:
    """The complete lines left in ``content``'s buffer after its error was set. Every public
    reader raises that error first, so this reads the buffer with ``_read_nowait``, the private
    step they all share (aiohttp 3.x; a rename fails mypy and
    tests/gateway/providers/test_providers_openai_compat.py). A line the break cut off is not an event."""
    *complete, _cut = content._read_nowait(-1).split(b"\n")
    return [line + b"\n" for line in complete]


_ALLOWED: dict[int, tuple[ModelSettings, frozenset[str]]] = {}  # id(model) -> (model, its allow-list)


def _allowed_keys(model: ModelSettings) -> frozenset[str]:
    """The fields ``model`` may receive, computed once per (immutable) model settings object."""
    hit = _ALLOWED.get(id(model))
    if hit is not None and hit[0] is model:
        return hit[1]
    allowed = SPECS["openai"].forward | (EXTENSION_PARAMS & set(model.extra_params))
    if len(_ALLOWED) >= 1024:
        _ALLOWED.clear()
    _ALLOWED[id(model)] = (model, allowed)
    return allowed


def _allowed(model: ModelSettings, body: dict[str, Any]) -> dict[str, Any]:
    """The allow-listed fields only (``provider_payload`` applied the same list, with 400s for
    the rest; taken again here so nothing else is ever re-encoded into the upstream request)."""
    allowed = _allowed_keys(model)
    return {k: v for k, v in body.items() if k in allowed}


class OpenAICompatProvider:
    """``ChatProvider`` over HTTP for any server speaking OpenAI chat completions."""

    def __init__(self, session_factory: SessionFactory | None = None, *,
                 connect_timeout_s: float = 10.0) -> None:
        self._factory = session_factory or default_session_factory
        self._session: aiohttp.ClientSession | None = None
        self._connect_timeout_s = connect_timeout_s
        self._timeouts: dict[tuple[float, bool], aiohttp.ClientTimeout] = {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = self._factory()
        return self._session

    def _timeout(self, model: ModelSettings, options: CallOptions, *, streaming: bool) -> aiohttp.ClientTimeout:
        limit = options.timeout_s or model.timeout_s
        timeout = self._timeouts.get((limit, streaming))
        if timeout is None:  # (immutable; one per limit, not one per call)
            # Streams may run long in total; each read must still arrive within the limit.
            timeout = aiohttp.ClientTimeout(total=None if streaming else limit, connect=self._connect_timeout_s,
                                            sock_read=limit)
            if len(self._timeouts) >= 64:
                self._timeouts.clear()
            self._timeouts[(limit, streaming)] = timeout
        return timeout

    @staticmethod
    def _url(model: ModelSettings) -> str:
        assert model.api_base, "openai provider needs api_base (validated in settings)"
        return model.api_base.rstrip("/") + "/chat/completions"

    async def complete(self, model: ModelSettings, body: dict[str, Any],
                       options: CallOptions = CallOptions()) -> dict[str, Any]:
        payload = {**_allowed(model, body), "model": model.model, "stream": False}
        try:
            async with self._client().post(self._url(model), data=orjson.dumps(payload), headers=_headers(model, options),
                                           timeout=self._timeout(model, options, streaming=False)) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise upstream_http_error(resp.status, raw, model, resp.headers.get("Retry-After"))
        except TimeoutError:
            raise UpstreamTimeout("upstream timed out", retryable=True) from None
        except aiohttp.ClientError as err:
            raise UpstreamError(f"upstream connection failed ({type(err).__name__})", retryable=True) from None
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError("upstream returned invalid JSON", retryable=True) from None
        if not isinstance(data, dict):
            raise UpstreamError("upstream returned an unexpected body", retryable=True)
        return data

    async def stream(self, model: ModelSettings, body: dict[str, Any],
                     options: CallOptions = CallOptions()) -> AsyncGenerator[dict[str, Any], None]:
        payload = {**_allowed(model, body), "model": model.model, "stream": True,
                   "stream_options": {"include_usage": True}}  # always ask: the ledger needs counts
        resp: aiohttp.ClientResponse | None = None
        finished = False
        closers = HANGUP_CLOSERS.get()
        try:
            try:
                resp = await self._client().post(self._url(model), data=orjson.dumps(payload),
                                                 headers=_headers(model, options),
                                                 timeout=self._timeout(model, options, streaming=True))
                if closers is not None:  # the client's hang-up drops this connection at once
                    closers.append(resp.close)
                if resp.status >= 400:
                    raw = await resp.read()
                    raise upstream_http_error(resp.status, raw, model, resp.headers.get("Retry-After"))
                async with contextlib.aclosing(_lines(resp.content)) as lines:
                    async for line in lines:
                        if not line.startswith(b"data:"):
                            continue  # comments, event:, blank separators
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            finished = True
                            break
                        if data:
                            yield orjson.loads(data)
                finished = True
            except TimeoutError:
                raise UpstreamTimeout("upstream timed out", retryable=True) from None
            except aiohttp.ClientError as err:
                raise UpstreamError(f"upstream connection failed ({type(err).__name__})",
                                    retryable=True) from None
            except orjson.JSONDecodeError:
                raise UpstreamError("upstream sent an invalid stream chunk", retryable=False) from None
        finally:
            if resp is not None:
                if closers is not None and resp.close in closers:
                    closers.remove(resp.close)
                if finished:
                    resp.release()
                else:
                    resp.close()  # consumer went away: drop the connection so the upstream stops

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
            await asyncio.sleep(0)
        self._session = None
