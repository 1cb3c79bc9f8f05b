"""Admin dashboard: auth (disabled without a key, bearer or signed session cookie, CSRF-safe
POSTs), numbers equal to the database's sums (spend/baseline/savings from daily_spend, tier mix
and pipeline share from requests), keyset paging, escaping, budget status and alerts."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest

from gateway.admin import SESSION_COOKIE, LoginThrottle, SessionSigner
from gateway.db.models import BudgetAlertRow
from gateway.db.queries import create_tenant
from gateway.money import nanos_to_decimal
from tests.gateway.admin.admin_support import ADMIN, db_sums, seed
from tests.gateway.gateway_harness import Gateway, gateway
from tests.gateway.scripted_upstream import ScriptedUpstream

BEARER = {"Authorization": f"Bearer {ADMIN}"}


pytestmark = pytest.mark.usefixtures("admin_key")


async def login(gw: Gateway) -> None:
    r = await gw.client.post("/admin/login", data={"admin_key": ADMIN})
    assert r.status_code == 303 and r.headers["location"] == "/admin"
    cookie = r.headers["set-cookie"]
    assert f"{SESSION_COOKIE}=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Path=/admin" in cookie and "Max-Age=" in cookie


async def test_disabled_without_an_admin_key(tmp_path: Path, upstream: ScriptedUpstream,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERGATE_ADMIN_KEY")
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.get("/admin")
        assert r.status_code == 403 and "TIERGATE_ADMIN_KEY" in r.text and "disabled" in r.text
        r = await gw.client.get("/admin/api/overview", headers=BEARER)
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
        assert (await gw.client.post("/admin/login", data={"admin_key": ""})).status_code == 403


async def test_login_session_cookie_and_bearer(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.get("/admin")
        assert r.status_code == 303 and r.headers["location"] == "/admin/login"
        assert (await gw.client.get("/admin/api/overview")).status_code == 401
        assert (await gw.client.get("/admin/api/overview", headers=gw.auth)).status_code == 401  # tenant key
        assert (await gw.client.get("/admin/api/overview", headers=BEARER)).status_code == 200
        r = await gw.client.post("/admin/login", data={"admin_key": "wrong"})
        assert r.status_code == 401 and "wrong admin key" in r.text and SESSION_COOKIE not in gw.client.cookies
        r = await gw.client.post("/admin/login", data={"admin_key": ADMIN}, headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and SESSION_COOKIE not in gw.client.cookies
        await login(gw)
        page = await gw.client.get("/admin")
        assert page.status_code == 200 and "Overview" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert (await gw.client.get("/admin/api/overview")).status_code == 200  # cookie works for JSON too
        token = gw.client.cookies[SESSION_COOKIE]
        assert (await gw.client.post("/admin/logout", headers={"Origin": "https://evil.example"})).status_code == 403
        assert (await gw.client.get("/admin/logout")).status_code == 405  # no state-changing GET
        r = await gw.client.post("/admin/logout")
        assert r.status_code == 303 and SESSION_COOKIE not in gw.client.cookies
        assert (await gw.client.get("/admin")).status_code == 303
        gw.client.cookies.set(SESSION_COOKIE, token[:-1] + ("0" if token[-1] != "0" else "1"))
        assert (await gw.client.get("/admin")).status_code == 303  # tampered
        assert (await gw.client.get("/admin/api/overview")).status_code == 401
        gw.client.cookies.set(SESSION_COOKIE, token)
        assert (await gw.client.get("/admin")).status_code == 200  # logout is client-side: the token itself lives on


def test_session_tokens_expire_and_are_bound_to_the_key() -> None:
    now = [1_000_000.0]
    signer = SessionSigner("k1", ttl_s=60, clock=lambda: now[0])
    token = signer.issue()
    assert signer.valid(token)
    assert not SessionSigner("k2", clock=lambda: now[0]).valid(token)
    assert not signer.valid(token.replace(".", "x", 1)) and not signer.valid(None) and not signer.valid("a.b")
    now[0] += 61
    assert not signer.valid(token)


def test_login_throttle_window() -> None:
    now = [0.0]
    t = LoginThrottle(max_failures=3, window_s=60, clock=lambda: now[0])
    for _ in range(3):
        assert t.retry_after_s("a") is None
        t.failed("a")
        now[0] += 10
    assert t.retry_after_s("a") == pytest.approx(30) and t.retry_after_s("b") is None
    now[0] += 31  # the first failure left the window
    assert t.retry_after_s("a") is None
    t.succeeded("a")
    t.failed("a")
    assert t.retry_after_s("a") is None


async def test_failed_logins_are_throttled(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        for _ in range(10):
            assert (await gw.client.post("/admin/login", data={"admin_key": "guess"})).status_code == 401
        r = await gw.client.post("/admin/login", data={"admin_key": ADMIN})  # even the right key, for now
        assert r.status_code == 429 and int(r.headers["retry-after"]) > 0 and SESSION_COOKIE not in gw.client.cookies


async def test_numbers_equal_the_database_sums(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        with gw.session_factory() as s, s.begin():
            other = create_tenant(s, "other-co").id
        recs = seed(gw, gw.tenant_id, 7) + seed(gw, other, 3)
        cost, base = db_sums(gw)
        assert cost == sum(nanos_to_decimal(r.cost_nanos) for r in recs)  # exact: integer nano-USD
        body = (await gw.client.get("/admin/api/overview?days=7", headers=BEARER)).json()
        assert Decimal(body["total"]["cost_usd"]) == cost and Decimal(body["total"]["baseline_cost_usd"]) == base
        assert Decimal(body["total"]["savings_usd"]) == base - cost > 0
        assert body["total"]["calls"] == 7 + 3 + 3 + 1  # pipeline requests make two upstream calls
        by_tenant = {t["name"]: t for t in body["tenants"]}
        assert set(by_tenant) == {"acme", "other-co"}
        assert Decimal(by_tenant["acme"]["cost_usd"]) == db_sums(gw, gw.tenant_id)[0]
        assert sum(Decimal(d["cost_usd"]) for d in body["per_day"]) == cost
        assert body["mix"] == {"hours": 24, "total": 10, "by_tier": {"low": 6, "high": 4}, "pipeline": 4,
                               "pipeline_share": 0.4, "refused": 0}
        assert by_tenant["other-co"]["mix"]["total"] == 3 and by_tenant["other-co"]["mix"]["pipeline"] == 1

        t = (await gw.client.get(f"/admin/api/tenants/{gw.tenant_id}?mix_hours=24", headers=BEARER)).json()
        assert t["mix"] == {"hours": 24, "total": 7, "by_tier": {"low": 4, "high": 3}, "pipeline": 3,
                            "pipeline_share": 3 / 7, "refused": 0}
        assert set(t["per_tier"]) == {"low", "high"} and t["per_tier"]["high"]["calls"] == 3
        narrow = (await gw.client.get(f"/admin/api/tenants/{gw.tenant_id}?mix_hours=3", headers=BEARER)).json()
        assert narrow["mix"]["total"] == 3  # the window bounds the mix (hours 0, 1, 2 ago)

        await login(gw)
        html = (await gw.client.get("/admin?days=7")).text
        assert f"${cost:.6f}" in html and f"${base - cost:.6f}" in html


async def test_recent_requests_keyset_paging(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        recs = seed(gw, gw.tenant_id, 5)
        seen: list[str] = []
        url = f"/admin/api/tenants/{gw.tenant_id}?limit=2"
        for _ in range(5):
            page = (await gw.client.get(url, headers=BEARER)).json()
            seen += [r["id"] for r in page["requests"]]
            if page["next"] is None:
                break
            url = (f"/admin/api/tenants/{gw.tenant_id}?limit=2&before_at={page['next']['before_at']}"
                   f"&before_id={page['next']['before_id']}")
        assert seen == [r.id for r in recs]  # newest first, each once
        await login(gw)
        first = (await gw.client.get(f"/admin/tenants/{gw.tenant_id}?limit=2")).text
        assert recs[0].id in first and recs[2].id not in first and "Older requests" in first
        bad = await gw.client.get(f"/admin/api/tenants/{gw.tenant_id}?before_at=yesterday&before_id=x",
                                  headers=BEARER)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "before_at"
        assert (await gw.client.get("/admin/api/tenants/nope", headers=BEARER)).status_code == 404


async def test_budget_alerts_and_escaping(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        with gw.session_factory() as s, s.begin():
            evil = create_tenant(s, "<script>alert(1)</script>").id
            s.add(BudgetAlertRow(id="al1", subject=f"tenant:{evil}", tenant_id=evil, period_key="2026-11",
                                 threshold_permille=800, spent_usd=Decimal("8.5"), limit_usd=Decimal("10"),
                                 created_at=datetime.now(UTC)))
        r = await gw.client.put(f"/admin/budgets/tenants/{evil}", headers=BEARER,
                                json={"period": "month", "limit_usd": "10"})
        assert r.status_code == 200, r.text
        t = (await gw.client.get(f"/admin/api/tenants/{evil}", headers=BEARER)).json()
        assert t["budget"]["hard_limit_usd"] == 10.0 and [a["threshold"] for a in t["alerts"]] == [0.8]
        await login(gw)
        for url in ("/admin", f"/admin/tenants/{evil}"):
            html = (await gw.client.get(url)).text
            assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
        html = (await gw.client.get(f"/admin/tenants/{evil}")).text
        assert "80.0%" in html and "8.500000" in html and "10.000000" in html
        css = await gw.client.get("/admin/static/admin.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        assert (await gw.client.get("/admin/static/..%2Fsession.py")).status_code == 404
