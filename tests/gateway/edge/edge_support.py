"""Helpers for the edge-hardening tests (not a test module): a gateway with batch jobs on SQLite
or a migrated PostgreSQL database, with the key store the lifespan builds from settings; a
request body that counts how much of it the server pulled; OpenAI error-shape checks; and
`tiergate serve` in a subprocess with its RSS read from /proc."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.app import create_app
from gateway.auth import generate_key, hash_key
from gateway.db import migrate
from gateway.db.queries import add_api_key, create_tenant
from gateway.db.session import make_engine, make_session_factory
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from tests.gateway.gateway_harness import Gateway, asgi_client
from tests.gateway.jobs_support import batch_config
from tests.gateway.scripted_upstream import ADMIN_KEY, ScriptedUpstream

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """The ``error`` object of a response in OpenAI's shape with this status."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in r.text
    return body["error"]  # type: ignore[no-any-return]


def new_tenant_and_key(sf: Any, name: str = "acme") -> tuple[str, str, str]:
    """(tenant id, key id, raw key) of a new tenant with one key."""
    raw = generate_key()
    with sf() as s, s.begin():
        tenant = create_tenant(s, name)
        key = add_api_key(s, tenant.id, raw, hash_key(raw), name="test")
        return tenant.id, key.id, raw


@asynccontextmanager
async def edge_gateway(tmp_path: Path, upstream: ScriptedUpstream, *, db_url: str | None = None,
                       server: dict[str, Any] | None = None, jobs: dict[str, Any] | None = None,
                       **config: Any) -> AsyncIterator[Gateway]:
    """A gateway with batch jobs over ``db_url`` (default: a fresh SQLite file), migrated with
    Alembic, one tenant with one key; ``server`` adds to the config's ``server:`` section."""
    url = db_url or f"sqlite:///{tmp_path / 'edge.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    sf = make_session_factory(engine)
    tenant_id, _, raw = new_tenant_and_key(sf)
    cfg = batch_config(upstream.base_url, url, jobs=jobs, **config)
    cfg["server"].update(server or {})
    settings = settings_from_dict(cfg, base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger))
    try:
        async with asgi_client(app) as client:
            yield Gateway(app, client, settings, upstream, ledger, sf, tenant_id, raw)
    finally:
        ledger.stop()
        engine.dispose()


class CountingBody:
    """A request body of ``chunks`` × ``size`` bytes that counts the chunks the server pulled."""

    def __init__(self, chunks: int, size: int = 64 * 1024, fill: bytes = b"x") -> None:
        self.chunks, self.size, self.fill, self.pulled = chunks, size, fill, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.chunks):
            self.pulled += 1
            yield self.fill * self.size


def nested(depth: int) -> Any:
    """``depth`` levels of JSON arrays around a number."""
    doc: Any = 1
    for _ in range(depth):
        doc = [doc]
    return doc


def nested_json(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


# ---- a real `tiergate serve` -----------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    port: int
    stderr: Path
    key: str
    tenant_id: str

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")


@contextmanager
def serve_subprocess(tmp_path: Path, upstream: ScriptedUpstream, *, server: dict[str, Any] | None = None,
                     env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                     sections: dict[str, Any] | None = None) -> Iterator[Served]:
    """`tiergate serve` on a fresh migrated SQLite database and a free port, stderr to a file
    (``args``: more command-line options; ``sections``: more config.yaml sections)."""
    db_url = f"sqlite:///{tmp_path / 'served.db'}"
    cfg = batch_config(upstream.base_url, db_url, journal_dir=str(tmp_path / "journal"))
    cfg["server"].update(server or {})
    cfg.update(sections or {})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    tenant_id, _, raw = new_tenant_and_key(make_session_factory(engine))
    engine.dispose()
    port, stderr = free_port(), tmp_path / "serve.stderr"
    proc = subprocess.Popen([sys.executable, "-c", "from gateway.cli import main; main()", "serve",
                             "--config", str(config), "--port", str(port), *args],
                            env={**os.environ, "TIERGATE_CONFIG": str(config), "TIERGATE_ADMIN_KEY": ADMIN_KEY,
                                 **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=stderr.open("wb"))
    served = Served(proc, port, stderr, raw, tenant_id)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, served.log()[-3000:]
            try:
                if httpx.get(f"{served.base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "gateway did not become ready:\n" + served.log()[-3000:]
            time.sleep(0.1)
        yield served
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
