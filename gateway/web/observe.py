"""``ObserveMiddleware``: one timing per HTTP request, to the last byte of its answer (a stream's
too), handed to the metrics (gateway.telemetry.metrics.record_http) and, when configured, to
the request log line (gateway.telemetry.logs), and the request's server span when tracing is on
(gateway.telemetry.tracing.server_span: current while the request runs) — labelled with the route template (looked up by
the endpoint the router chose; ``unmatched`` for a 404), and with
the tier and routed model when a route made a routing decision (it leaves its ``ChatRequest`` in
``scope["tiergate.request"]``). A request that ends without a response started is a 499 when
the client left, else 500. Pure ASGI, a few microseconds per request.

Imports starlette types and gateway.telemetry only.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.telemetry import metrics, tracing

REQUEST_KEY = "tiergate.request"
UNMATCHED = "unmatched"


class ObserveMiddleware:
    def __init__(self, app: ASGIApp, *, paths: dict[Any, str], metrics_on: bool = True,
                 request_log: Any = None, tracing_on: bool = False) -> None:
        self.app = app
        self.paths = paths  # endpoint -> route template (the router leaves the endpoint in the scope)
        self.metrics_on = metrics_on
        self.request_log = request_log  # gateway.telemetry.logs.RequestLog or None
        self.tracing_on = tracing_on

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        span = tracing.server_span(scope) if self.tracing_on else None
        failed: BaseException | None = None
        try:
            await self.app(scope, receive, observed_send)
        except BaseException as err:
            failed = err
            raise
        finally:
            seconds = time.perf_counter() - started
            if not status:
                status = 500 if failed is not None else 499
            path = self.paths.get(scope.get("endpoint"), UNMATCHED)
            if span is not None:
                tracing.end_server_span(span, None if path is UNMATCHED else path, status, failed)
            req = scope.get(REQUEST_KEY)
            tier, model = (req.decision.tier, req.decision.models[0]) if req is not None else ("", "")
            if self.metrics_on:
                metrics.record_http(path, tier, model, status, seconds)
            if self.request_log is not None:
                self.request_log.write(scope, path, tier, model, status, seconds, req)
