"""``create_app``: the FastAPI application factory. Nothing is built at import time: the
lifespan opens the process's ``Runtime`` (gateway.runtime), with whatever parts the caller hands
in (tests pass small real ones), and puts it at ``app.state.tiergate``. Errors are mapped here, once, to
OpenAI's error shape — never a stack trace or a secret in a response (gateway.web.edge answers
and logs whatever escapes a route).

Other engineers add their router with one ``app.include_router(...)`` line in ``_routers``.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.telemetry import TelemetryConfig
from opentelemetry.sdk.trace import TracerProvider
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from gateway.errors import GatewayError, NotFound
from gateway.runtime import RuntimeParts, open_runtime
from gateway.settings import Settings
from gateway.telemetry import tracing
from gateway.telemetry.logs import RequestLog
from gateway.web.edge import EdgeMiddleware
from gateway.web.gc_pacing import pace_collections
from gateway.web.observe import Observer
from gateway.web.request_body import FORM_OVERHEAD_BYTES, invalid_value


def _error_response(err: GatewayError) -> Response:
    return Response(orjson.dumps(err.body()), status_code=err.status, media_type="application/json",
                    headers=err.headers or None)


async def _gateway_error(_: Request, err: Exception) -> Response:
    assert isinstance(err, GatewayError)
    return _error_response(err)


async def _validation_error(_: Request, err: Exception) -> Response:
    assert isinstance(err, RequestValidationError)
    return _error_response(invalid_value(dict((err.errors() or [{}])[0])))


_HTTP_CODES = {405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type"}


async def _http_error(_: Request, err: Exception) -> Response:
    assert isinstance(err, StarletteHTTPException)
    if err.status_code == 404:
        return _error_response(NotFound("not found"))
    client_side = err.status_code < 500
    gerr = GatewayError(str(err.detail) if client_side else "server error",
                        code=_HTTP_CODES.get(err.status_code, "invalid_request" if client_side else "server_error"))
    gerr.status, gerr.type = err.status_code, "invalid_request_error" if client_side else "server_error"
    return _error_response(gerr)


def _routers(app: FastAPI) -> None:
    from gateway.routes import admin as admin_routes
    from gateway.routes import (
        admin_api,
        admin_forms,
        admin_keys,
        batches,
        budgets,
        chat,
        feedback,
        files,
        health,
        models,
        openapi,
    )
    from gateway.routes import messages as anthropic_messages
    from gateway.routes import metrics as metrics_route

    # The chat route first: routers are matched in order, each one a scan of its routes, and this is
    # the hot path (no other router has a route its path could match).
    app.include_router(chat.router)
    app.include_router(anthropic_messages.router)
    app.include_router(health.router)
    app.include_router(budgets.router)
    app.include_router(models.router)
    app.include_router(feedback.router)
    app.include_router(admin_routes.router)
    app.include_router(admin_keys.router)
    app.include_router(admin_api.router)
    app.include_router(admin_forms.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(openapi.router)
    app.include_router(metrics_route.router)


def route_templates(routes: list[Any]) -> dict[Any, str]:
    """Each endpoint's route template (the metrics' ``route`` label). FastAPI keeps an included
    router as one wrapper route (``original_router``); its routes are looked at in turn."""
    out: dict[Any, str] = {}
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            out.update(route_templates(inner.routes))
        elif isinstance(route, Route):
            out[route.endpoint] = route.path
    return out


# The GIL switch interval of a server process (``TIERGATE_SWITCH_INTERVAL_S`` overrides it): the
# ledger's journal and DB threads share the GIL with the event loop, and Python's default 5 ms
# lets them hold it that long while a response waits; 0.2 ms halves the gateway's added latency
# under load (`tiergate bench gateway`).
SWITCH_INTERVAL_S = 0.0002


def _freeze_startup_heap(stack: AsyncExitStack) -> None:
    """Collect, then move every object alive after startup into the GC's permanent generation
    until shutdown (``create_app(freeze_heap=True)``, as ``tiergate serve`` builds it).

    A full (generation-2) collection walks every tracked object with the event loop stopped.
    After imports and startup that is ~120-240k objects (FastAPI, SQLAlchemy, pydantic, the
    classifier stack): 60-280 ms during which every in-flight request stalls, every few seconds
    under load (``tiergate bench ledger`` saw all 32 in-flight requests stall ~150 ms). Frozen,
    those objects are never scanned, so full collections only walk what requests leave behind.
    The collection first keeps garbage out of the frozen heap (a frozen cycle is never freed),
    including what an earlier app in the same process handed back at its shutdown. Off by
    default: that collection costs ~100 ms per app start, which a process that starts many
    (the tests) should not pay; a server starts one.

    The youngest generation's threshold is raised too (700 -> gateway.web.gc_pacing's
    ``GEN0_THRESHOLD`` net new container objects): at 700 the collector ran every ~130 requests
    and cost 12-20 us per request (the chat route driven in process at 32 concurrent requests;
    0.6-0.9 us at 10,000). With ``TIERGATE_GC_INTERVAL_S`` set (opt-in), collections run on a
    clock instead (``pace_collections``; see that module for why, and why not by default).
    Restored at shutdown.

    And the process's GIL switch interval is set to ``SWITCH_INTERVAL_S`` until shutdown, so every
    app built as a server (``tiergate serve`` and the benches that build the app in process alike)
    runs with the same one."""
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(float(os.environ.get("TIERGATE_SWITCH_INTERVAL_S", SWITCH_INTERVAL_S)))
    stack.callback(sys.setswitchinterval, old_interval)
    gc.collect()
    gc.freeze()
    stack.callback(gc.unfreeze)


def create_app(settings: Settings, parts: RuntimeParts = RuntimeParts(), *, freeze_heap: bool = False,
               tracer_provider: TracerProvider | None = None) -> FastAPI:
    """Build the app. Its lifespan opens the ``Runtime`` (``gateway.runtime``): the parts not
    handed in are built there and closed when the app stops. ``freeze_heap``: after startup,
    freeze the heap out of full garbage collections (see ``_freeze_startup_heap``); servers pass
    True."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            app.state.tiergate = await stack.enter_async_context(open_runtime(settings, parts))
            if freeze_heap:
                _freeze_startup_heap(stack)
                await pace_collections(stack)
            yield

    # Traces (observability.tracing): this process's tracer for the server span (the edge's Observer:
    # it continues a client's traceparent) and the stage and upstream spans below it. FastAPI's own
    # telemetry stays off, whatever global provider the environment set up: one server span, not two.
    tracing_on = tracing.configure(settings.observability.tracing, tracer_provider) is not None
    telemetry: TelemetryConfig = {"metrics": False, "logs": False, "operation_spans": False,
                                  "tracing": False, "tracer_provider": None}
    app = FastAPI(title="tiergate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=telemetry)
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    observe = settings.observability
    _routers(app)
    observer = None
    if observe.metrics.enabled or observe.logs.request_lines or tracing_on:  # timed by the edge: its 500s too
        observer = Observer(paths=route_templates(app.router.routes), metrics_on=observe.metrics.enabled,
                            tracing_on=tracing_on, request_log=RequestLog() if observe.logs.request_lines else None)
    # Any other exception: EdgeMiddleware answers 500 and logs its type and place, never its text.
    app.add_middleware(EdgeMiddleware, max_body_bytes=max(settings.server.max_body_bytes,
                                                          settings.jobs.max_file_bytes + FORM_OVERHEAD_BYTES),
                       observer=observer)
    return app
