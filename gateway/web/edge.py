"""``EdgeMiddleware``: the outermost layer of the app (inside Starlette's ServerErrorMiddleware,
which it never lets an exception reach).

- Any exception a route lets escape becomes a 500 in OpenAI's shape and one log line with its
  type and where it happened (gateway.log_safety.describe) — never its text (a database error
  quotes SQL parameters: file names, uploaded bytes) and never a traceback. Starlette's own
  handler for ``Exception`` would send the 500 and then re-raise, and uvicorn would log the
  whole traceback.
- A client that goes away mid-body (Starlette's ``ClientDisconnect``) is one debug line.
- A response that starts before the request body has been read to its end (a 401 before a
  100 MB upload, a 413, a 408) closes the connection (``connection: close``), so the rest of
  that body is never read and discarded on a keep-alive connection.
- No body may exceed ``max_body_bytes`` however a route reads it (the routes' own, lower limits
  come from gateway.web.request_body).

Imports starlette, errors and log_safety only.
"""

from __future__ import annotations

import logging

import orjson
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import GatewayError, PayloadTooLarge
from gateway.log_safety import describe

log = logging.getLogger("tiergate.edge")
SERVER_ERROR = GatewayError("The server had an error while processing your request.")


def _has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        unread = _has_body(scope)  # True until the body's last message has been received
        received = 0
        started = False
        limit = self.max_body_bytes

        async def edge_receive() -> Message:
            nonlocal unread, received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    unread = False
                if received > limit:
                    raise PayloadTooLarge(f"request body is larger than the limit of {limit} bytes")
            return message

        async def edge_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if unread:
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, edge_receive, edge_send)
        except ClientDisconnect:
            log.debug("client closed the connection before sending its whole request body")
        except Exception as exc:
            log.error("unhandled %s", describe(exc))
            if not started:
                body = orjson.dumps(SERVER_ERROR.body())
                await edge_send({"type": "http.response.start", "status": 500,
                                 "headers": [(b"content-type", b"application/json"),
                                             (b"content-length", str(len(body)).encode())]})
                await edge_send({"type": "http.response.body", "body": body})
