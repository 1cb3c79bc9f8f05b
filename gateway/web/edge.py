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
- With an ``observer`` (gateway.web.observe: metrics, request log lines, the tracing server
  span), every request is timed to the last byte of its answer, 500s answered here included,
  from this layer's own ``send`` wrapper: observability adds no ASGI layer of its own.

Imports starlette, errors, log_safety, gateway.telemetry.tracing and gateway.web.observe only.
"""

from __future__ import annotations

import logging
import time

import orjson
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import GatewayError, PayloadTooLarge
from gateway.log_safety import describe
from gateway.telemetry import tracing
from gateway.web.observe import Observer

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
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, observer: Observer | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.observer = observer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        observer, span, t0 = self.observer, None, 0.0
        if observer is not None:
            t0 = time.perf_counter()
            span = tracing.server_span(scope) if observer.tracing_on else None
        unread = _has_body(scope)  # True until the body's last message has been received
        received = 0
        status = 0  # the response's, once started
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
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if unread:
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        failed: BaseException | None = None
        try:
            await self.app(scope, edge_receive, edge_send)
        except ClientDisconnect:
            log.debug("client closed the connection before sending its whole request body")
        except Exception as exc:
            log.error("unhandled %s", describe(exc))
            if not status:
                body = orjson.dumps(SERVER_ERROR.body())
                await edge_send({"type": "http.response.start", "status": 500,
                                 "headers": [(b"content-type", b"application/json"),
                                             (b"content-length", str(len(body)).encode())]})
                await edge_send({"type": "http.response.body", "body": body})
        except BaseException as err:  # cancelled (the client left, the server stops): not answered here
            failed = err
            raise
        finally:
            if observer is not None:
                observer.finish(scope, span, status, time.perf_counter() - t0, failed)
