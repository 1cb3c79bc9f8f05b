"""Redis stopped and restarted under a budgeted gateway (a private redis-server on its own port,
stopped and started by the test; the shared one on 6379 is never touched): never a 500.

- ``fail_closed``: while Redis is down a budgeted request is a 503 ``service_unavailable`` in
  OpenAI's error shape with ``retry-after``, refused before any upstream call;
- ``fail_open_to_local``: requests are served against each replica's local counters, loaded from
  the database and held to ``redis_outage_local_share`` of the limit (a share too small for one
  request's hold refuses it with the ordinary 429 ``budget_exceeded``);
- after the restart (Redis comes back empty) the counters are rebuilt from the database: the
  budget's spent equals the ledger's sum, the spend of the outage included.

Before the outage policy, a budgeted request with Redis down was a 500."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.budgets.policies import put_policy
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from tests.gateway.gateway_harness import Gateway, asgi_client, make_database
from tests.gateway.scripted_upstream import ADMIN_KEY, ScriptedUpstream, config_for

pytestmark = [pytest.mark.integration, pytest.mark.process, pytest.mark.slow, pytest.mark.redis]

MSGS = [{"role": "user", "content": "hello"}]
BODY = {"model": "low", "messages": MSGS, "max_tokens": 10}


class PrivateRedis:
    """A redis-server of the test's own, with no persistence: a restart loses every key."""

    def __init__(self, directory: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.directory = directory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.directory)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    r = PrivateRedis(tmp_path)
    r.start()
    try:
        yield r
    finally:
        r.stop()


@asynccontextmanager
async def _gateway(tmp_path: Path, upstream: ScriptedUpstream, budgets: dict[str, Any]) -> Any:
    url, sf, tenant_id, raw = make_database(tmp_path)
    with sf() as s, s.begin():
        put_policy(s, scope="tenant", tenant_id=tenant_id, period="month", limit_usd=Decimal(1))
    cfg = config_for(upstream.base_url, db_url=url)
    cfg["budgets"] = budgets
    cfg["redis"] = {"url_env": "TIERGATE_TEST_PRIVATE_REDIS_URL", "timeout_s": 0.5}
    settings = settings_from_dict(cfg, base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf)))
    try:
        async with asgi_client(app) as client:
            yield Gateway(app, client, settings, upstream, ledger, sf, tenant_id, raw)
    finally:
        ledger.stop()


async def _spent_equals_ledger(gw: Gateway) -> None:
    """The tenant's budget counter converges to the ledger's sum: it is rebuilt from the database
    at Redis's recovery and once more a second later (the last rows may still be on their way)."""
    total = sum((x.cost_usd for x in gw.ledger_rows()), Decimal(0))
    spent = None
    for _ in range(40):  # 40 polls of 0.1 s at most
        r = await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}",
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200, r.text
        spent = Decimal(str(r.json()["status"]["spent_usd"]))
        if spent == total:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"budget spent {spent} != ledger sum {total}")


async def test_fail_closed_refuses_with_503_and_rebuilds_after_restart(
        tmp_path: Path, upstream: ScriptedUpstream, private_redis: PrivateRedis, admin_key: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_TEST_PRIVATE_REDIS_URL", private_redis.url)
    async with _gateway(tmp_path, upstream, {"redis_outage": "fail_closed"}) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=BODY)
        assert r.status_code == 200, r.text
        calls = len(upstream.requests)

        private_redis.stop()
        for body in (BODY, {**BODY, "stream": True}):
            r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=body)
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("server_error", "service_unavailable")
            assert set(err) == {"message", "type", "param", "code"}
        assert len(upstream.requests) == calls  # refused before any upstream work

        private_redis.start()  # back, empty: the counters are cold-loaded from the database
        for _ in range(3):
            r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=BODY)
            assert r.status_code == 200, r.text
        await _spent_equals_ledger(gw)


@pytest.mark.parametrize(("share", "during_outage"), [(1.0, 200), (0.000001, 429)])
async def test_fail_open_to_local_serves_on_local_counters(
        tmp_path: Path, upstream: ScriptedUpstream, private_redis: PrivateRedis, admin_key: str,
        monkeypatch: pytest.MonkeyPatch, share: float, during_outage: int) -> None:
    monkeypatch.setenv("TIERGATE_TEST_PRIVATE_REDIS_URL", private_redis.url)
    budgets = {"redis_outage": "fail_open_to_local", "redis_outage_local_share": share}
    async with _gateway(tmp_path, upstream, budgets) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=BODY)
        assert r.status_code == 200, r.text

        private_redis.stop()
        for body in (BODY, {**BODY, "stream": True}):
            r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=body)
            assert r.status_code == during_outage, r.text
            if during_outage == 429:  # the local share ($1 x 1e-6) cannot hold one request
                assert r.json()["error"]["code"] == "budget_exceeded"

        private_redis.start()
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=BODY)
        assert r.status_code == 200, r.text
        await _spent_equals_ledger(gw)  # the outage's local spend is in the rebuilt counter
