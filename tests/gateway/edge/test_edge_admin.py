"""The admin surface at the edge: every budget value is bounded (admin API and CLI; an
unbounded ``limit_usd`` once broke every request of its tenant), every admin key a client sends
is throttled per client address (bearer tokens on /admin/api and /admin/budgets too, not only
the login form), and a revoked API key stops working on every replica within
``server.key_cache_ttl_s`` — revoked through the admin API or by `tiergate keys revoke` in
another process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from gateway.app import create_app
from gateway.cli import budgets_cmd
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from tests.gateway.cli_support import admin_cli_root
from tests.gateway.edge.edge_support import ADMIN, edge_gateway, new_tenant_and_key, openai_error
from tests.gateway.gateway_harness import Gateway
from tests.gateway.scripted_upstream import ADMIN_KEY, ScriptedUpstream, config_for

pytestmark = pytest.mark.usefixtures("admin_key")
CHAT = {"model": "low", "messages": [{"role": "user", "content": "hi"}]}


# ---- item 6: bounded budget values ------------------------------------------------------------

def test_usd_bounds() -> None:
    from decimal import Decimal

    from gateway.budgets.bounds import PolicyValueError, usd

    assert usd("limit_usd", 0) == 0 and usd("limit_usd", "0.000000001") > 0 and usd("limit_usd", 1e8) == 10**8
    assert usd("limit_usd", 1.5 * 2.3e-05) == Decimal("0.000034500")  # a computed float: its binary noise rounds
    for bad in (1e-12, "0.0000000015", 1e8 + 1, 1e20, -1, "nan", "inf", "abc", True):
        with pytest.raises(PolicyValueError) as info:
            usd("limit_usd", bad)  # type: ignore[arg-type]
        assert info.value.param == "limit_usd"


@pytest.mark.parametrize(("update", "param"), [
    ({"limit_usd": 1e20}, "limit_usd"),
    ({"limit_usd": 1e10}, "limit_usd"),
    ({"limit_usd": "100000000.000000001"}, "limit_usd"),
    ({"limit_usd": 1e-12}, "limit_usd"),
    ({"limit_usd": "0.0000000015"}, "limit_usd"),
    ({"soft_limit_usd": 1e-12}, "soft_limit_usd"),
    ({"limit_usd": 1, "soft_limit_usd": 2}, "soft_limit_usd"),
    ({"alert_thresholds": [0.5, 1.5]}, "alert_thresholds"),
    ({"alert_thresholds": [0]}, "alert_thresholds"),
    ({"alert_thresholds": [-0.5]}, "alert_thresholds"),
    ({"alert_thresholds": []}, "alert_thresholds"),
    ({"alert_thresholds": [0.1] * 11}, "alert_thresholds"),
    ({"requests_per_min": 10**12}, "requests_per_min"),
    ({"tokens_per_min": 10**12}, "tokens_per_min"),
])
async def test_admin_budget_values_are_bounded(tmp_path: Path, upstream: ScriptedUpstream,
                                               update: dict[str, Any], param: str) -> None:
    async with edge_gateway(tmp_path, upstream) as gw:
        for url in (f"/admin/budgets/tenants/{gw.tenant_id}", f"/admin/budgets/keys/{_key_id(gw)}"):
            err = openai_error(await gw.client.put(url, headers=ADMIN, json=update), 400)
            assert err["param"] == param and err["type"] == "invalid_request_error", err
            assert (await gw.client.get(url, headers=ADMIN)).json()["policy"] is None  # nothing stored
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=CHAT)
        assert r.status_code == 200, r.text


async def test_contradictions_against_the_stored_policy(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with edge_gateway(tmp_path, upstream) as gw:
        url = f"/admin/budgets/tenants/{gw.tenant_id}"
        r = await gw.client.put(url, headers=ADMIN, json={"limit_usd": 5, "soft_limit_usd": 4,
                                                           "alert_thresholds": [0.5, 1.0]})
        assert r.status_code == 200, r.text
        assert openai_error(await gw.client.put(url, headers=ADMIN, json={"soft_limit_usd": 6}), 400)["param"] \
            == "soft_limit_usd"
        assert openai_error(await gw.client.put(url, headers=ADMIN, json={"limit_usd": 3}), 400)["param"] \
            == "soft_limit_usd"
        policy = (await gw.client.get(url, headers=ADMIN)).json()["policy"]
        assert (policy["limit_usd"], policy["soft_limit_usd"]) == (5, 4)  # unchanged
        r = await gw.client.put(url, headers=ADMIN, json={"limit_usd": "0.000000001", "soft_limit_usd": 0})
        assert r.status_code == 200 and r.json()["policy"]["limit_usd"] == 1e-9
        r = await gw.client.put(url, headers=ADMIN, json={"limit_usd": 100_000_000, "soft_limit_usd": 1})
        assert r.status_code == 200
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=CHAT)
        assert r.status_code == 200, r.text  # the largest limit does not break the tenant's requests


def _key_id(gw: Gateway) -> str:
    from gateway.db.models import ApiKey

    with gw.session_factory() as s:
        return str(s.query(ApiKey.id).filter(ApiKey.tenant_id == gw.tenant_id).scalar())


def test_cli_budget_values_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, config = admin_cli_root(tmp_path, monkeypatch, "b.db")
    root.add_typer(budgets_cmd.app, name="budgets")
    runner = CliRunner()

    def run(*args: str) -> Any:
        return runner.invoke(root, [*args, "--config", str(config)])

    assert run("db", "upgrade").exit_code == 0 and run("tenants", "create", "acme").exit_code == 0
    for args, param in [(["--limit-usd", "1e20"], "limit_usd"), (["--limit-usd", "1e-12"], "limit_usd"),
                        (["--limit-usd", "1", "--soft-limit-usd", "2"], "soft_limit_usd"),
                        (["--alerts", "0.5,1.5"], "alert_thresholds"), (["--alerts", "half"], "alert_thresholds"),
                        (["--rpm", str(10**12)], "requests_per_min")]:
        result = run("budgets", "set", "--tenant", "acme", *args)
        assert result.exit_code == 2 and param in result.output, (args, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit)
    assert run("budgets", "set", "--tenant", "acme", "--limit-usd", "12.5", "--alerts", "0.5,1").exit_code == 0


# ---- item 7: throttled admin credentials --------------------------------------------------------

@asynccontextmanager
async def _client_from(gw: Gateway, host: str) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=gw.app, client=(host, 4321))
    async with httpx.AsyncClient(transport=transport, base_url="http://tiergate") as client:
        yield client


@pytest.mark.parametrize("path", ["/admin/api/overview", "/admin/budgets/tenants/{tenant}"])
async def test_wrong_bearer_admin_keys_are_throttled(tmp_path: Path, upstream: ScriptedUpstream, path: str) -> None:
    async with edge_gateway(tmp_path, upstream) as gw:
        url = path.format(tenant=gw.tenant_id)
        async with _client_from(gw, "203.0.113.7") as attacker, _client_from(gw, "198.51.100.2") as other:
            for i in range(10):
                openai_error(await attacker.get(url, headers={"Authorization": f"Bearer guess-{i}"}), 401)
            for key in ("guess-10", ADMIN_KEY):  # refused without comparing, even the right key
                r = await attacker.get(url, headers={"Authorization": f"Bearer {key}"})
                err = openai_error(r, 429)
                assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
                assert 0 < int(r.headers["retry-after"]) <= 301
            # the budget API and the dashboard share one throttle, the login form too
            openai_error(await attacker.put(f"/admin/budgets/tenants/{gw.tenant_id}",
                                            headers={"Authorization": "Bearer x"}, json={}), 429)
            assert (await attacker.post("/admin/login", data={"admin_key": ADMIN_KEY})).status_code == 429
            # another address is not affected
            assert (await other.get(url, headers=ADMIN)).status_code == 200


# ---- item 9: revocation within the bound on every replica ----------------------------------------

@asynccontextmanager
async def _replica(gw: Gateway, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A second gateway process's app on the same database, its key store built from settings."""
    ledger = Ledger(gw.session_factory, tmp_path / "journal-b", flush_interval_ms=5)
    ledger.start()
    app = create_app(gw.settings, RuntimeParts(session_factory=gw.session_factory, ledger=ledger))
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://replica-b") as client:
            yield client
    finally:
        ledger.stop()


async def _refused_within(client: httpx.AsyncClient, auth: dict[str, str], since: float, bound_s: float) -> float:
    """Seconds from ``since`` until ``client`` refuses the key (polled every 20 ms)."""
    while True:
        r = await client.get("/v1/models", headers=auth)
        elapsed = time.monotonic() - since
        if r.status_code == 401:
            return elapsed
        assert r.status_code == 200 and elapsed < bound_s + 0.5, f"key still accepted after {elapsed:.2f} s"
        await asyncio.sleep(0.02)


async def test_admin_revoke_api_on_one_replica_reaches_the_other(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with edge_gateway(tmp_path, upstream) as gw, _replica(gw, tmp_path) as replica:
        ttl = gw.settings.server.key_cache_ttl_s
        assert ttl <= 1.0
        _, key_id, raw = new_tenant_and_key(gw.session_factory, "victim")
        auth = {"Authorization": f"Bearer {raw}"}
        for client in (gw.client, replica):
            assert (await client.get("/v1/models", headers=auth)).status_code == 200  # cached on both
        openai_error(await gw.client.post(f"/admin/api/keys/{key_id}/revoke", headers=gw.auth), 401)
        r = await gw.client.post(f"/admin/api/keys/{key_id}/revoke", headers=ADMIN)
        revoked = time.monotonic()
        assert r.status_code == 200 and r.json()["id"] == key_id and r.json()["revoked_at"]
        openai_error(await gw.client.get("/v1/models", headers=auth), 401)  # this replica: at once
        assert await _refused_within(replica, auth, revoked, ttl) <= ttl + 0.2
        again = await gw.client.post(f"/admin/api/keys/{key_id}/revoke", headers=ADMIN)  # idempotent
        assert again.status_code == 200 and again.json()["revoked_at"] == r.json()["revoked_at"]
        err = openai_error(await gw.client.post("/admin/api/keys/key_nope/revoke", headers=ADMIN), 404)
        assert err["param"] == "key_id"
        # a dashboard session (cookie) may revoke only from the dashboard's own origin
        assert (await gw.client.post("/admin/login", data={"admin_key": ADMIN_KEY})).status_code == 303
        r = await gw.client.post(f"/admin/api/keys/{key_id}/revoke", headers={"Origin": "https://evil.example"})
        assert openai_error(r, 403)["code"] == "permission_denied"


@pytest.mark.process
def test_cli_revoke_in_another_process_within_the_bound(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async def scenario() -> None:
        async with edge_gateway(tmp_path, upstream) as gw:
            ttl = gw.settings.server.key_cache_ttl_s
            _, key_id, raw = new_tenant_and_key(gw.session_factory, "victim")
            auth = {"Authorization": f"Bearer {raw}"}
            assert (await gw.client.get("/v1/models", headers=auth)).status_code == 200
            config = tmp_path / "cli.yaml"
            db_url = str(gw.session_factory.kw["bind"].url)
            config.write_text(yaml.safe_dump(config_for(upstream.base_url, db_url=db_url)))
            cli = asyncio.create_task(asyncio.to_thread(
                subprocess.run, [sys.executable, "-c", "from gateway.cli import main; main()", "keys", "revoke",
                                 key_id, "--config", str(config)], capture_output=True, text=True, timeout=120))
            while not cli.done():  # keep the key hot in this replica's cache while the other process works
                assert (await gw.client.get("/v1/models", headers=auth)).status_code in (200, 401)
                await asyncio.sleep(0.05)
            revoked = time.monotonic()  # the other process has committed and exited
            assert cli.result().returncode == 0, cli.result().stderr
            assert (await _refused_within(gw.client, auth, revoked, ttl)) <= ttl + 0.2

    asyncio.run(scenario())
