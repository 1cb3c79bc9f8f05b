"""``POST /v1/chat/completions``: thin HTTP shell around ``ChatFlow`` (auth, raw body with a
size limit, orjson, SSE, the client's disconnect). Policy lives in gateway.chat and gateway.routing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import orjson
from fastapi import APIRouter, Request, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.chat.request import ChatRequest
from gateway.chat.sse import ChatStream
from gateway.money import format_usd
from gateway.providers.base import HANGUP_CLOSERS
from gateway.web.hangup import on_hangup
from gateway.web.observe import REQUEST_KEY
from gateway.web.request_body import read_json

if TYPE_CHECKING:  # the route takes its collaborators from app.state; it imports none of them
    from gateway.runtime import Runtime

router = APIRouter()


class SSEResponse(StreamingResponse):
    """Streams a ``ChatStream`` and always closes it — shielded, so the upstream is cancelled and
    the generated tokens billed however the response ends.

    The client's disconnect: under ``tiergate serve`` the server reports it the moment the
    connection is lost (gateway.web.hangup) and the hook, in that callback, cancels the streaming
    task and drops the stream's upstream connections (``HANGUP_CLOSERS``), so the upstream
    call stops without waiting for a task to be scheduled, however far apart the chunks are;
    the task then bills what was delivered. Elsewhere (test transports, another server) Starlette watches
    ``receive()`` for ``http.disconnect`` beside the send loop, as before."""

    def __init__(self, stream: ChatStream, headers: dict[str, str],
                 upstreams: list[Callable[[], None]] | None = None) -> None:
        self._body = stream.__aiter__()
        super().__init__(self._body, media_type="text/event-stream", headers=headers)
        self._chat_stream = stream
        self._upstreams = upstreams if upstreams is not None else []  # HANGUP_CLOSERS of the stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        me = asyncio.current_task()
        streaming, hung_up = True, False

        def hangup() -> None:  # in the server's connection_lost: the task cancelled, the upstream dropped
            nonlocal hung_up
            if streaming and not hung_up and me is not None:
                hung_up = True
                me.cancel(_HUNG_UP)
                for close in list(self._upstreams):
                    close()

        try:
            if me is None or not on_hangup(scope, hangup):
                await super().__call__(scope, receive, send)
                return
            try:
                await self.stream_response(send)
            except asyncio.CancelledError:
                if not hung_up or me.cancelling() != 1:  # a shutdown, not (only) the client leaving
                    raise
                me.uncancel()
        finally:
            streaming = False
            with anyio.CancelScope(shield=True):
                await self._body.aclose()
                await self._chat_stream.close()


_HUNG_UP = "tiergate: the client hung up"


def _gone(request: Request) -> Awaitable[object]:
    """What ends when the client disconnects: under a server that reports the hang-up in its
    callback (gateway.web.hangup) a future that callback resolves (no task has to wake up to
    notice), else a watch of ``receive()``."""
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def hung_up() -> None:
        if not gone.done():
            gone.set_result(None)

    if on_hangup(request.scope, hung_up):
        return gone
    return _client_gone(request.receive)


async def _client_gone(receive: Receive) -> None:
    """Returns when the server reports that the client disconnected. Starlette does not cancel a
    non-streaming handler then; after the body has been read, the next ASGI message is
    ``http.disconnect`` (uvicorn sends it when the connection is lost, test transports only after
    the response)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _json(content: object, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), media_type="application/json", headers=headers)


def _decision_headers(req: ChatRequest) -> dict[str, str]:
    d = req.decision
    headers = {"x-request-id": req.request_id, "x-tiergate-tier": d.tier, "x-tiergate-effort": d.tier,
               "x-tiergate-effort-source": d.effort_source}
    if d.classifier_score is not None:  # the classifier decided: say how and which version
        headers["x-tiergate-effort-score"] = f"{d.classifier_score:.4f}"
        headers["x-tiergate-classifier-version"] = str(d.classifier_version)
    return headers


async def chat_completions(request: Request) -> Response:
    # A plain Starlette route (added below), not a FastAPI one: the hot path skips dependency
    # solving. Same steps as the deps: the runtime, then the key, then the body (gateway.web.request_body).
    rt: Runtime = request.app.state.tiergate
    who = await rt.keys.authenticate(request.headers.get("authorization"))
    data = await read_json(request, rt.settings.server)
    req, stream = await rt.flow.prepare(who, data)
    request.scope[REQUEST_KEY] = req  # its id, tenant, tier and model: for its metrics and log line
    headers = _decision_headers(req)
    if stream:
        upstreams: list[Callable[[], None]] = []
        HANGUP_CLOSERS.set(upstreams)  # the stream's upstream connections, dropped at a hang-up
        chat_stream = await rt.flow.open_stream(req, client_gone=_gone(request))
        headers.update(chat_stream.headers)  # cost headers: the usage chunk
        return SSEResponse(chat_stream, {**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
                           upstreams)
    outcome = await rt.flow.complete(req, client_gone=_gone(request))
    spend = outcome.spend
    headers["x-tiergate-cost-usd"] = format_usd(spend.cost_nanos)
    headers["x-tiergate-saved-usd"] = format_usd(spend.baseline_nanos - spend.cost_nanos)
    headers.update(outcome.headers)
    return _json(outcome.response, headers)


router.add_route("/v1/chat/completions", chat_completions, methods=["POST"], include_in_schema=False)
