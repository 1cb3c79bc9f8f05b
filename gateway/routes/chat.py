"""``POST /v1/chat/completions``: thin HTTP shell around ``ChatFlow`` (auth, raw body with a
size limit, orjson, SSE, the client's disconnect). Policy lives in chat_flow / resolve / execution.
"""

from __future__ import annotations

import anyio
import orjson
from fastapi import APIRouter, Request, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.chat_flow import ChatStream
from gateway.money import format_usd
from gateway.request_body import read_json
from gateway.runtime import Runtime

router = APIRouter()


class SSEResponse(StreamingResponse):
    """Streams a ``ChatStream`` and always closes it — even when the client disconnects and
    Starlette cancels the send loop (it watches for the disconnect while waiting on every chunk
    under ASGI spec < 2.4, as uvicorn's HTTP servers report) — shielded so the upstream is
    cancelled and the generated tokens billed."""

    def __init__(self, stream: ChatStream, headers: dict[str, str]) -> None:
        super().__init__(stream.__aiter__(), media_type="text/event-stream", headers=headers)
        self._chat_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                body = self.body_iterator
                aclose = getattr(body, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._chat_stream.close()


async def _client_gone(receive: Receive) -> None:
    """Returns when the server reports that the client disconnected. Starlette does not cancel a
    non-streaming handler then; after the body has been read, the next ASGI message is
    ``http.disconnect`` (uvicorn sends it when the connection is lost, test transports only after
    the response)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _json(content: object, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), media_type="application/json", headers=headers)


async def chat_completions(request: Request) -> Response:
    # A plain Starlette route (added below), not a FastAPI one: the hot path skips dependency
    # solving. Same steps as the deps: app state, then the key, then the body (gateway.request_body).
    state: Runtime = request.app.state.tiergate
    who = await state.keys.authenticate(request.headers.get("authorization"))
    data = await read_json(request, state.settings.server)
    rr, req = state.flow.prepare(who, data)
    headers = {"x-request-id": rr.request_id, "x-tiergate-tier": rr.resolution.tier,
               "x-tiergate-effort-source": rr.resolution.effort_source}
    if rr.resolution.classifier_score is not None:  # the classifier decided: say how and which version
        headers["x-tiergate-effort-score"] = f"{rr.resolution.classifier_score:.4f}"
        headers["x-tiergate-classifier-version"] = str(rr.resolution.classifier_version)
    if req.stream:
        stream = await state.flow.open_stream(rr, req.include_usage, client_gone=_client_gone(request.receive))
        headers["x-tiergate-tier"] = headers["x-tiergate-effort"] = rr.tally.effort or rr.resolution.tier
        headers["x-tiergate-effort-source"] = rr.tally.effort_source or rr.resolution.effort_source
        headers.update(rr.tally.response_headers)
        return SSEResponse(stream, {**headers, "cache-control": "no-cache", "x-accel-buffering": "no"})
    response = await state.flow.complete(rr, client_gone=_client_gone(request.receive))
    t = rr.tally
    headers["x-tiergate-tier"] = headers["x-tiergate-effort"] = t.effort or rr.resolution.tier  # after any cap
    headers["x-tiergate-effort-source"] = t.effort_source or rr.resolution.effort_source
    headers["x-tiergate-cost-usd"] = format_usd(t.cost_nanos)
    headers["x-tiergate-saved-usd"] = format_usd(t.baseline_cost_nanos - t.cost_nanos)
    headers.update(t.response_headers)
    return _json(response, headers)


router.add_route("/v1/chat/completions", chat_completions, methods=["POST"], include_in_schema=False)
