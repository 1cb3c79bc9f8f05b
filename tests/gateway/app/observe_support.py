"""The real app for the observability tests (not a test module): a fresh SQLite database, the
real ledger and key store, the scripted upstream, and extra config sections merged in."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from tests.gateway.gateway_harness import Gateway, asgi_client, make_database
from tests.gateway.scripted_upstream import ScriptedUpstream, config_for


@asynccontextmanager
async def app_with(tmp_path: Path, upstream: ScriptedUpstream, tracer_provider: TracerProvider | None = None,
                   **extra: Any) -> AsyncIterator[Gateway]:
    """The real app over a fresh database with ``extra`` config sections merged in."""
    url, sf, tenant_id, raw = make_database(tmp_path)
    settings = settings_from_dict({**config_for(upstream.base_url, db_url=url), **extra}, base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf)),
                     tracer_provider=tracer_provider)
    try:
        async with asgi_client(app) as client:
            yield Gateway(app, client, settings, upstream, ledger, sf, tenant_id, raw)
    finally:
        ledger.stop()
