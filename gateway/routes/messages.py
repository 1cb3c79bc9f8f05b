"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages API, a
thin HTTP shell over gateway.chat.anthropic and the same ``ChatFlow`` as the chat route (auth,
routing, budgets, ledger). The key comes in ``x-api-key`` (Anthropic's SDKs) or
``Authorization: Bearer``; every error is in Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``) with the same status and headers the chat
route would send — an unexpected failure too (a 500 ``api_error``, logged as the edge logs it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import orjson
from fastapi import APIRouter, Request, Response

from gateway.auth import Principal
from gateway.chat.anthropic import (
    count_input_tokens,
    new_message_id,
    parse_count_tokens_request,
    parse_messages_request,
    to_chat_body,
)
from gateway.chat.anthropic_reply import AnthropicStream, anthropic_error, to_message
from gateway.errors import AuthenticationFailed, GatewayError
from gateway.log_safety import describe
from gateway.money import format_usd
from gateway.routes.chat import SSEResponse, _client_gone, _decision_headers
from gateway.web.edge import SERVER_ERROR
from gateway.web.observe import REQUEST_KEY
from gateway.web.request_body import read_json

if TYPE_CHECKING:
    from gateway.runtime import Runtime

router = APIRouter()
log = logging.getLogger("tiergate.edge")


def _error(err: GatewayError) -> Response:
    return Response(orjson.dumps(anthropic_error(err)), status_code=err.status, media_type="application/json",
                    headers=err.headers or None)


async def _authenticate(rt: Runtime, request: Request) -> Principal:
    api_key = request.headers.get("x-api-key")
    header = f"Bearer {api_key}" if api_key is not None else request.headers.get("authorization")
    if not header:
        raise AuthenticationFailed("Missing API key. Send 'x-api-key: <key>' or 'Authorization: Bearer <key>'.")
    return await rt.keys.authenticate(header)


async def _messages(request: Request) -> Response:
    rt: Runtime = request.app.state.tiergate
    who = await _authenticate(rt, request)
    wire = parse_messages_request(await read_json(request, rt.settings.server), rt.settings.server.unknown_fields)
    req, stream = await rt.flow.prepare(who, to_chat_body(wire), request_id=new_message_id())
    request.scope[REQUEST_KEY] = req  # its id, tenant, tier and model: for its metrics and log line
    headers = {**_decision_headers(req), "request-id": req.request_id}
    if stream:
        opened = await rt.flow.open_stream(req, client_gone=_client_gone(request.receive))
        headers.update(opened.headers)
        return SSEResponse(AnthropicStream(opened, wire.thinking_enabled),
                           {**headers, "cache-control": "no-cache", "x-accel-buffering": "no"})
    outcome = await rt.flow.complete(req, client_gone=_client_gone(request.receive))
    spend = outcome.spend
    headers["x-tiergate-cost-usd"] = format_usd(spend.cost_nanos)
    headers["x-tiergate-saved-usd"] = format_usd(spend.baseline_nanos - spend.cost_nanos)
    headers.update(outcome.headers)
    message = to_message(outcome.response, req.request_id, req.decision.requested_model, spend.usage,
                         wire.thinking_enabled)
    return Response(orjson.dumps(message), media_type="application/json", headers=headers)


async def messages(request: Request) -> Response:
    try:
        return await _messages(request)
    except GatewayError as err:
        return _error(err)
    except Exception as exc:  # as gateway.web.edge does (log its type and place, never its text), in Anthropic's shape
        log.error("unhandled %s", describe(exc))
        return _error(SERVER_ERROR)


async def count_tokens(request: Request) -> Response:
    try:
        rt: Runtime = request.app.state.tiergate
        who = await _authenticate(rt, request)
        wire = parse_count_tokens_request(await read_json(request, rt.settings.server),
                                          rt.settings.server.unknown_fields)
        tokens = count_input_tokens(rt.flow, who, wire)
    except GatewayError as err:
        return _error(err)
    return Response(orjson.dumps({"input_tokens": tokens}), media_type="application/json")


router.add_route("/v1/messages", messages, methods=["POST"], include_in_schema=False)
router.add_route("/v1/messages/count_tokens", count_tokens, methods=["POST"], include_in_schema=False)
