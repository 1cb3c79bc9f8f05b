"""PostgreSQL stopped under load and started again (a private server: initdb + pg_ctl in a
temporary data directory on a port of its own, run as the ``postgres`` user; the shared server on
5432 is never touched). The issue's 30 s outage is shortened to ~6 s, longer than every cache in
front of the database here (API keys 0.2 s, budget policies 5 s).

While it is down every request is still served — keys and budget policies from their caches
(however old), budget holds in memory, spend to the ledger's journal — and ``/readyz`` says
``degraded`` (200, ``database: false``). When it is back the journal drains: every upstream call
has exactly one ledger row (none lost, none doubled), and ``daily_spend`` equals the ledger."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.app import create_app
from gateway.auth import KeyStore, generate_key, hash_key
from gateway.budgets.policies import put_policy
from gateway.db import migrate
from gateway.db.models import DailySpend, LedgerEntryRow, LedgerIntentRow
from gateway.db.queries import add_api_key, create_tenant
from gateway.db.session import make_engine, make_session_factory
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from tests.gateway.gateway_harness import asgi_client
from tests.gateway.scripted_upstream import ScriptedUpstream, config_for

pytestmark = [pytest.mark.integration, pytest.mark.process, pytest.mark.slow]

PG_BIN = Path("/usr/lib/postgresql/15/bin")
OUTAGE_S = 6.0
BODY = {"model": "low", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


class PrivatePostgres:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tiergate-pg-"))
        shutil.chown(self.dir, "postgres", "postgres")
        self.data = self.dir / "data"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / tool), *args], check=True,
                       capture_output=True, cwd=self.dir)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / "pg_ctl"), "-D", str(self.data),
                        "-m", "immediate", "stop"], capture_output=True, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    if os.geteuid() != 0 or not (PG_BIN / "initdb").exists() or shutil.which("runuser") is None:
        pytest.skip("needs root, runuser and PostgreSQL 15's binaries")
    pg = PrivatePostgres()
    try:
        pg.start()
        yield pg
    finally:
        pg.remove()


async def test_requests_are_served_through_a_postgres_outage_and_the_journal_drains(
        tmp_path: Path, upstream: ScriptedUpstream, private_postgres: PrivatePostgres) -> None:
    migrate.upgrade(private_postgres.url)
    engine = make_engine(private_postgres.url)
    sf = make_session_factory(engine)
    raw = generate_key()
    with sf() as s, s.begin():
        tenant_id = create_tenant(s, "acme").id
        add_api_key(s, tenant_id, raw, hash_key(raw))
        put_policy(s, scope="tenant", tenant_id=tenant_id, period="month", limit_usd=Decimal(5))
    auth = {"Authorization": f"Bearer {raw}"}
    settings = settings_from_dict(config_for(upstream.base_url, db_url=private_postgres.url), base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5, retry_max_s=0.5)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf, ttl_s=0.2)))
    try:
        async with asgi_client(app) as client:
            for i in range(4):  # warm: the key, the policy and the budget counter are read once
                r = await client.post("/v1/chat/completions", headers=auth, json={**BODY, "stream": i % 2 == 1})
                assert r.status_code == 200, r.text

            await asyncio.to_thread(private_postgres.stop)
            served = 0
            end = time.monotonic() + OUTAGE_S
            while time.monotonic() < end:
                r = await client.post("/v1/chat/completions", headers=auth, json={**BODY, "stream": served % 2 == 1})
                assert r.status_code == 200, r.text
                served += 1
                await asyncio.sleep(0.1)
            ready = await client.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert (ready.json()["status"], ready.json()["database"]) == ("degraded", False)
            assert ready.json()["ledger_state"]["pending_db"] > 0  # the outage's rows wait in the journal

            await asyncio.to_thread(private_postgres.start)
            assert await ledger.aflush(30)  # the journal drains
            for _ in range(50):  # 50 polls of 0.1 s at most: the pool reconnects
                ready = await client.get("/readyz")
                if ready.json()["status"] == "ok":
                    break
                await asyncio.sleep(0.1)
            assert ready.status_code == 200 and ready.json()["status"] == "ok", ready.text
            r = await client.post("/v1/chat/completions", headers=auth, json=BODY)
            assert r.status_code == 200, r.text
    finally:
        ledger.stop()
    assert served >= 20
    with sf() as s:
        rows = list(s.scalars(sa.select(LedgerEntryRow)))
        daily = s.scalar(sa.select(sa.func.coalesce(sa.func.sum(DailySpend.cost_usd), 0)))
        daily_calls = s.scalar(sa.select(sa.func.coalesce(sa.func.sum(DailySpend.requests), 0)))
        intents = s.scalar(sa.select(sa.func.count()).select_from(LedgerIntentRow))
    engine.dispose()
    assert len(rows) == len(upstream.requests) == 4 + served + 1  # 0 lost, 0 doubled
    assert len({r.id for r in rows}) == len(rows) and all(r.status == "ok" for r in rows)
    assert daily == sum((r.cost_usd for r in rows), Decimal(0)) and daily_calls == len(rows)
    assert intents == 0
