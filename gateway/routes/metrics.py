"""``GET /metrics``: the Prometheus exposition (gateway.telemetry.metrics), merged over every
worker process. ``observability.metrics.auth: admin`` (the default) asks for the admin key as a
bearer token, as the admin API does; ``none`` leaves it open (for a network only the scraper
reaches). 404 when ``observability.metrics.enabled`` is false. The scrape-time collectors
(batch lines from the database, the bundled engine's queues and KV usage) run off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response

from gateway.errors import NotFound
from gateway.routes.admin_auth import require_admin
from gateway.telemetry import metrics
from gateway.telemetry.collectors import BatchLinesCollector, EngineCollector

if TYPE_CHECKING:
    from gateway.runtime import Runtime

router = APIRouter()


def _collectors(rt: Runtime) -> list[Any]:
    out: list[Any] = [BatchLinesCollector(rt.session_factory)]
    local = rt.registry.loaded_local
    engines = getattr(local, "loaded_engines", None)
    if engines is not None:
        out.append(EngineCollector(engines))
    return out


async def scrape(request: Request) -> Response:
    rt: Runtime = request.app.state.tiergate
    cfg = rt.settings.observability.metrics
    if not cfg.enabled:
        raise NotFound("not found")
    if cfg.auth == "admin":
        await require_admin(request)
    body, content_type = await asyncio.to_thread(metrics.exposition, _collectors(rt))
    return Response(body, media_type=content_type)


router.add_route("/metrics", scrape, methods=["GET"], include_in_schema=False)
