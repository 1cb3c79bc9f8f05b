"""A real, small gateway for app tests: SQLite in a temp dir, the real journaled ``Ledger`` and
``KeyStore``, one tenant with one key, create_app's lifespan run around an httpx ASGI client,
every tier pointed at a ``ScriptedUpstream``."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
import uvicorn
from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker

from gateway.app import create_app
from gateway.auth import KeyStore, generate_key, hash_key
from gateway.db.models import Base, Feedback, LedgerEntryRow, Request
from gateway.db.queries import add_api_key, create_tenant
from gateway.db.session import make_engine, make_session_factory
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import Settings, settings_from_dict
from tests import lanes
from tests.gateway.scripted_upstream import ScriptedUpstream, config_for


def make_database(tmp_path: Path) -> tuple[str, sessionmaker[Session], str, str]:
    """(db url, session factory, tenant id, raw key) on a fresh SQLite file."""
    url = f"sqlite:///{tmp_path / 'tiergate.db'}"
    engine = make_engine(url)
    Base.metadata.create_all(engine)
    sf = make_session_factory(engine)
    raw = generate_key()
    with sf() as s, s.begin():
        tenant = create_tenant(s, "acme")
        add_api_key(s, tenant.id, raw, hash_key(raw), name="test")
        tenant_id = tenant.id
    return url, sf, tenant_id, raw


@dataclass
class Gateway:
    app: FastAPI
    client: httpx.AsyncClient
    settings: Settings
    upstream: ScriptedUpstream
    ledger: Ledger
    session_factory: sessionmaker[Session]
    tenant_id: str
    key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    async def feedback_rows(self) -> list[Feedback]:
        """The feedback rows, polled until the recorder (it writes off the event loop) has
        written one; empty when none came within ~4 s."""
        rows: list[Feedback] = []
        for _ in range(200):
            with self.session_factory() as s:
                rows = list(s.scalars(sa.select(Feedback)))
            if rows:
                break
            await asyncio.sleep(0.02)
        return rows

    def ledger_rows(self) -> list[LedgerEntryRow]:
        assert self.ledger.flush(10)
        with self.session_factory() as s:
            return list(s.scalars(sa.select(LedgerEntryRow).order_by(LedgerEntryRow.created_at)))

    def request_rows(self) -> list[Request]:
        assert self.ledger.flush(10)
        with self.session_factory() as s:
            return list(s.scalars(sa.select(Request)))


@asynccontextmanager
async def asgi_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """``app``'s lifespan run around an httpx client that calls it in-process."""
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://tiergate") as client:
        yield client


@contextmanager
def _app_with_ledger(tmp_path: Path, upstream: ScriptedUpstream,
                     **config: Any) -> Iterator[tuple[FastAPI, Callable[[httpx.AsyncClient], Gateway]]]:
    """The app over a fresh database and a started ledger (stopped on exit); yields the app and
    a function that wraps a client into the test's ``Gateway`` handles."""
    url, sf, tenant_id, raw = make_database(tmp_path)
    settings = settings_from_dict(config_for(upstream.base_url, db_url=url, **config), base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf)))
    try:
        yield app, lambda client: Gateway(app, client, settings, upstream, ledger, sf, tenant_id, raw)
    finally:
        ledger.stop()


@asynccontextmanager
async def gateway(tmp_path: Path, upstream: ScriptedUpstream, **config: Any) -> AsyncIterator[Gateway]:
    with _app_with_ledger(tmp_path, upstream, **config) as (app, handles):
        async with asgi_client(app) as client:
            yield handles(client)


@contextmanager
def served(app: FastAPI, *, http: Any = "auto") -> Iterator[str]:
    """Run ``app`` under a real uvicorn server in a thread on a loopback port; yields its /v1 URL.
    ``http``: uvicorn's HTTP protocol (``HeaderTimeoutHttpTools``: the one ``tiergate serve``
    runs). A real server on a socket: the test must be marked integration (tests/lanes.py)."""
    lanes.note("integration", "it served the gateway under uvicorn on a loopback socket")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", loop="asyncio", http=http))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


@contextmanager
def served_gateway(tmp_path: Path, upstream: ScriptedUpstream, *, http: Any = "auto",
                   **config: Any) -> Iterator[tuple[str, Gateway]]:
    """A real gateway (SQLite, ledger, key store) behind uvicorn; yields (base URL, handles)."""
    with _app_with_ledger(tmp_path, upstream, **config) as (app, handles), served(app, http=http) as base:
        yield base, handles(httpx.AsyncClient(base_url=base))
