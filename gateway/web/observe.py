"""``Observer``: one timing per HTTP request, to the last byte of its answer (a stream's too),
handed to the metrics (gateway.telemetry.metrics.record_http) and, when configured, to the
request log line (gateway.telemetry.logs), and the request's server span when tracing is on
(gateway.telemetry.tracing.server_span: current while the request runs) — labelled with the
route template (looked up by the endpoint the router chose; ``unmatched`` for a 404), and with
the tier and routed model when a route made a routing decision (it leaves its ``ChatRequest`` in
``scope["tiergate.request"]``). A request that ends without a response started is a 499 when
the client left, else 500.

Not an ASGI layer of its own: gateway.web.edge.EdgeMiddleware, the app's outermost layer, starts
the server span (``tracing.server_span`` when ``tracing_on``) before the request and calls
``finish`` after it (its 500s included), with the status its one wrapper of ``send`` saw. A layer of its own cost every request a coroutine frame that each
resumption of the request passes through and a second ``send`` wrapper (an observed request's
Python calls are what its observability costs: ``tiergate bench obs-paired``).

Imports gateway.telemetry only.
"""

from __future__ import annotations

from typing import Any

from gateway.telemetry import metrics, tracing

REQUEST_KEY = "tiergate.request"
UNMATCHED = "unmatched"


class Observer:
    __slots__ = ("metrics_on", "paths", "request_log", "tracing_on")

    def __init__(self, *, paths: dict[Any, str], metrics_on: bool = True, request_log: Any = None,
                 tracing_on: bool = False) -> None:
        self.paths = paths  # endpoint -> route template (the router leaves the endpoint in the scope)
        self.metrics_on = metrics_on
        self.request_log = request_log  # gateway.telemetry.logs.RequestLog or None
        self.tracing_on = tracing_on

    def finish(self, scope: Any, span: tracing.ServerSpan | None, status: int, seconds: float,
               failed: BaseException | None) -> None:
        """The request answered ``status`` (0: no response started) after ``seconds``; ``failed``:
        the exception it ended with, if any."""
        if not status:
            status = 500 if failed is not None else 499
        path = self.paths.get(scope.get("endpoint"), UNMATCHED)
        if span is not None:
            tracing.end_server_span(span, None if path is UNMATCHED else path, status, failed)
        req = scope.get(REQUEST_KEY)
        if req is not None:
            decision = req.decision
            tier, model = decision.tier, decision.models[0]
        else:
            tier = model = ""
        if self.metrics_on:
            metrics.record_http(path, tier, model, status, seconds)
        if self.request_log is not None:
            self.request_log.write(scope, path, tier, model, status, seconds, req)
