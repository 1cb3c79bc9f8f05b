"""Budgets through the HTTP app: 64 concurrent chat requests against a budget that fits 10
(scripted upstream, real ledger and key store), the remaining-budget header, 429
``budget_exceeded`` in OpenAI's error shape, and the admin API that sets the budget."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from pathlib import Path

import pytest

from tests.gateway.gateway_harness import gateway
from tests.gateway.scripted_upstream import ADMIN_KEY, ScriptedUpstream

ADMIN = ADMIN_KEY
pytestmark = pytest.mark.usefixtures("admin_key")
# An empty message: the gateway's prompt bound for holds (3 + 8 per message + the text's bytes,
# ``prompt_token_bound``) is 11 tokens, exactly what the scripted upstream reports (10 + 1
# message), so worst case == actual and the outcome is exact.
BODY = {"model": "low", "messages": [{"role": "user", "content": ""}], "max_tokens": 4}
COST = Decimal(11 * 1 + 4 * 2) / Decimal(10**6)



@pytest.mark.slow
async def test_64_concurrent_http_requests_against_budget_for_10(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = await gw.client.put(f"/admin/budgets/tenants/{gw.tenant_id}", headers=admin,
                                json={"period": "day", "limit_usd": str(COST * Decimal("10.5"))})
        assert r.status_code == 200, r.text
        assert r.json()["policy"]["limit_usd"] == pytest.approx(float(COST) * 10.5)

        async def one() -> tuple[int, dict, dict]:  # type: ignore[type-arg]
            resp = await gw.client.post("/v1/chat/completions", json=BODY, headers=gw.auth)
            return resp.status_code, resp.json(), dict(resp.headers)

        results = await asyncio.gather(*(one() for _ in range(64)))
        ok = [r for r in results if r[0] == 200]
        denied = [r for r in results if r[0] == 429]
        assert len(ok) == 10 and len(denied) == 54
        assert all(d[1]["error"]["code"] == "budget_exceeded" and d[1]["error"]["type"] == "insufficient_quota"
                   for d in denied)
        assert all("x-tiergate-budget-remaining-usd" in r[2] for r in results)
        assert min(float(r[2]["x-tiergate-budget-remaining-usd"]) for r in ok) == pytest.approx(float(COST) / 2)
        assert len(upstream.requests) == 10  # denied requests never reached the upstream
        for _ in range(3):  # denied stays denied
            code, body, _ = await one()
            assert code == 429 and body["error"]["code"] == "budget_exceeded"
        rows = gw.ledger_rows()
        assert len(rows) == 10 and sum((row.cost_usd for row in rows), Decimal(0)) == 10 * COST
        status = (await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}", headers=admin)).json()["status"]
        assert Decimal(str(status["spent_usd"])) == 10 * COST and status["held_usd"] == 0
        assert status["soft_exceeded"]  # 95% spent, past the default soft limit (80%)
        for _ in range(100):  # alerts are recorded off the request path
            alerts = (await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}/alerts", headers=admin)).json()
            if len(alerts["data"]) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted(a["threshold"] for a in alerts["data"]) == [0.5, 0.8]  # once each, not 1.0


async def test_admin_api_needs_the_admin_key(tmp_path: Path, upstream: ScriptedUpstream,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    async with gateway(tmp_path, upstream) as gw:
        url = f"/admin/budgets/tenants/{gw.tenant_id}"
        assert (await gw.client.get(url)).status_code == 401
        assert (await gw.client.get(url, headers=gw.auth)).status_code == 401  # a tenant key is not admin
        r = await gw.client.put(url, headers={"Authorization": f"Bearer {ADMIN}"}, json={"period": "year"})
        assert r.status_code == 400 and r.json()["error"]["param"]
        assert (await gw.client.get("/admin/budgets/tenants/nope",
                                    headers={"Authorization": f"Bearer {ADMIN}"})).status_code == 404
        monkeypatch.delenv("TIERGATE_ADMIN_KEY")
        assert (await gw.client.get(url, headers={"Authorization": f"Bearer {ADMIN}"})).status_code == 403


async def test_streams_settle_to_what_they_cost(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        await gw.client.put(f"/admin/budgets/tenants/{gw.tenant_id}", headers=admin, json={"limit_usd": "1"})
        async with gw.client.stream("POST", "/v1/chat/completions", headers=gw.auth,
                                    json={**BODY, "stream": True}) as r:
            assert r.status_code == 200
            assert float(r.headers["x-tiergate-budget-remaining-usd"]) == pytest.approx(1 - float(COST))
            text = "".join([line async for line in r.aiter_lines()])
        assert "[DONE]" in text
        status = (await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}", headers=admin)).json()["status"]
        rows = gw.ledger_rows()
        assert len(rows) == 1 and Decimal(str(status["spent_usd"])) == rows[0].cost_usd == COST
        assert status["held_usd"] == 0
