"""The console acts (issue 15): the admin HTTP API and the console's forms create tenants and keys,
revoke keys, set/raise/clear tenant and key budgets and acknowledge alerts; each action is in
the audit log with who, what, before and after; forms are CSRF-safe (token tied to the session)
and actions throttled. And the defects the issue lists for the console: the overview's budget
view (limit, remaining, % used, refused, open alerts), the tier mix counting 429-refused requests
and sorting tiers by name, no key column or key budgets on the tenant page, raw alert ids and
timestamps without saying that no webhook is configured."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.admin import ActionLimiter, SessionSigner
from gateway.db.models import AdminAuditRow, ApiKey, BudgetAlertRow, BudgetPolicyRow, Tenant
from tests.gateway.admin.admin_support import ADMIN, seed
from tests.gateway.gateway_harness import Gateway, gateway
from tests.gateway.scripted_upstream import ScriptedUpstream

BEARER = {"Authorization": f"Bearer {ADMIN}"}
REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.usefixtures("admin_key")


def audit_rows(gw: Gateway) -> list[AdminAuditRow]:
    with gw.session_factory() as s:
        return list(s.scalars(sa.select(AdminAuditRow).order_by(AdminAuditRow.created_at)))


async def test_api_creates_tenant_and_key_revokes_and_audits(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/admin/api/tenants", json={"name": "beta co"}, headers=BEARER)
        assert r.status_code == 201, r.text
        tenant = r.json()
        assert tenant["name"] == "beta co" and tenant["object"] == "tenant"
        r = await gw.client.post("/admin/api/tenants", json={"name": "beta co"}, headers=BEARER)
        assert r.status_code == 400 and r.json()["error"]["code"] == "already_exists"
        r = await gw.client.post("/admin/api/tenants", json={"name": "<script>"}, headers=BEARER)
        assert r.status_code == 400 and r.json()["error"]["param"] == "name"
        r = await gw.client.post("/admin/api/tenants", json={"name": "x", "id": "ten_mine"}, headers=BEARER)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
        assert (await gw.client.post("/admin/api/tenants", json={"name": "y"}, headers=gw.auth)).status_code == 401

        r = await gw.client.post(f"/admin/api/tenants/{tenant['id']}/keys", json={"name": "ci"}, headers=BEARER)
        assert r.status_code == 201
        key = r.json()
        secret = key["key"]
        with gw.session_factory() as s:
            row = s.get(ApiKey, key["id"])
            assert row is not None and row.tenant_id == tenant["id"] and secret not in (row.key_hash, row.prefix)
        models = await gw.client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})
        assert models.status_code == 200  # the new key works at once
        listed = (await gw.client.get(f"/admin/api/tenants/{tenant['id']}/keys", headers=BEARER)).json()["data"]
        assert [k["id"] for k in listed] == [key["id"]] and "key" not in listed[0]

        r = await gw.client.post(f"/admin/api/keys/{key['id']}/revoke", headers=BEARER)
        assert r.status_code == 200 and r.json()["revoked"]
        assert (await gw.client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})).status_code == 401
        assert (await gw.client.post("/admin/api/tenants/ten_nope/keys", json={}, headers=BEARER)).status_code == 404

        rows = audit_rows(gw)
        assert [(a.action, a.actor) for a in rows] == [("tenant.create", "bearer"), ("key.create", "bearer"),
                                                      ("key.revoke", "bearer")]
        assert rows[2].before["revoked"] is False and rows[2].after["revoked"] is True
        assert all(secret not in str(a.after) for a in rows)  # the secret is never audited
        api = (await gw.client.get(f"/admin/api/audit?tenant_id={tenant['id']}", headers=BEARER)).json()["data"]
        assert [a["action"] for a in api] == ["key.revoke", "key.create", "tenant.create"]


async def test_api_sets_raises_and_clears_budgets(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        url = f"/admin/api/tenants/{gw.tenant_id}/budget"
        r = await gw.client.put(url, json={"raise_by_usd": "1"}, headers=BEARER)
        assert r.status_code == 400 and r.json()["error"]["param"] == "raise_by_usd"  # nothing to raise yet
        r = await gw.client.put(url, json={"limit_usd": "5", "period": "day", "requests_per_min": 60}, headers=BEARER)
        assert r.status_code == 200, r.text
        assert r.json()["policy"]["limit_usd"] == "5" and r.json()["status"]["hard_limit_usd"] == 5.0
        r = await gw.client.put(url, json={"raise_by_usd": "2.5"}, headers=BEARER)
        assert r.json()["policy"]["limit_usd"] == "7.5"
        shown = (await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}", headers=BEARER)).json()
        assert shown["policy"]["limit_usd"] == 7.5 and shown["status"]["hard_limit_usd"] == 7.5
        r = await gw.client.put(url, json={"limit_usd": "-1"}, headers=BEARER)
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit_usd"
        r = await gw.client.put(url, json={"soft_limit_usd": "9"}, headers=BEARER)  # above the hard limit
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
        r = await gw.client.put(url, json={"clear": ["limit_usd", "requests_per_min"]}, headers=BEARER)
        assert r.json()["policy"]["limit_usd"] is None and r.json()["policy"]["requests_per_min"] is None

        key = (await gw.client.post(f"/admin/api/tenants/{gw.tenant_id}/keys", json={}, headers=BEARER)).json()
        r = await gw.client.put(f"/admin/api/keys/{key['id']}/budget", json={"limit_usd": "0.25"}, headers=BEARER)
        assert r.status_code == 200 and r.json()["subject"] == f"key:{key['id']}"
        with gw.session_factory() as s:
            row = s.get(BudgetPolicyRow, f"key:{key['id']}")
            assert row is not None and row.limit_usd == Decimal("0.25")
        listed = (await gw.client.get(f"/admin/api/tenants/{gw.tenant_id}/keys", headers=BEARER)).json()["data"]
        assert listed[0]["budget"]["limit_usd"] == "0.25"

        acts = [(a.action, a.before and a.before["limit_usd"], a.after["limit_usd"]) for a in audit_rows(gw)
                if a.action.startswith("budget")]
        assert acts == [("budget.set", None, "5"), ("budget.raise", "5", "7.5"), ("budget.clear", "7.5", None),
                        ("budget.set", None, "0.25")]
        shown = (await gw.client.get(f"/admin/api/audit?tenant_id={gw.tenant_id}", headers=BEARER)).json()["data"]
        assert shown[3]["change"] == "limit_usd: 5 → 7.5"  # the raise, for people
        assert shown[2]["change"] == "limit_usd: 7.5 → –; requests_per_min: 60 → –"


async def test_acknowledge_alert(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        with gw.session_factory.begin() as s:
            s.add(BudgetAlertRow(id="alert_1", subject=f"tenant:{gw.tenant_id}", tenant_id=gw.tenant_id,
                                 period_key="2026-12", threshold_permille=800, spent_usd=Decimal(4),
                                 limit_usd=Decimal(5), created_at=datetime.now(UTC), attempts=0))
        over = (await gw.client.get("/admin/api/overview", headers=BEARER)).json()
        assert over["tenants"][0]["open_alerts"] == 1
        r = await gw.client.post("/admin/api/alerts/alert_1/acknowledge", headers=BEARER)
        assert r.status_code == 200 and r.json()["acknowledged_at"] is not None
        first = r.json()["acknowledged_at"]
        assert (await gw.client.post("/admin/api/alerts/alert_1/acknowledge", headers=BEARER)).json()[
            "acknowledged_at"] == first  # idempotent
        assert (await gw.client.get("/admin/api/overview", headers=BEARER)).json()["tenants"][0]["open_alerts"] == 0
        assert [a.action for a in audit_rows(gw)] == ["alert.acknowledge"]
        assert (await gw.client.post("/admin/api/alerts/nope/acknowledge", headers=BEARER)).status_code == 404


async def _session(gw: Gateway) -> str:
    r = await gw.client.post("/admin/login", data={"admin_key": ADMIN})
    assert r.status_code == 303
    page = (await gw.client.get(f"/admin/tenants/{gw.tenant_id}")).text
    m = re.search(r'name="csrf" value="([^"]+)"', page)
    assert m, "the tenant page carries the session's CSRF token in its forms"
    return m.group(1)


async def test_forms_are_csrf_safe_and_audited_with_the_session(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        csrf = await _session(gw)
        url = f"/admin/actions/tenants/{gw.tenant_id}/budget"
        back = f"/admin/tenants/{gw.tenant_id}"
        r = await gw.client.post(url, data={"limit_usd": "3", "back": back})
        assert r.status_code == 403 and "CSRF" in r.text  # no token
        r = await gw.client.post(url, data={"limit_usd": "3", "csrf": "0" * 64, "back": back})
        assert r.status_code == 403
        other = SessionSigner(ADMIN).issue()  # another session's token does not fit this session
        r = await gw.client.post(url, data={"limit_usd": "3", "csrf": SessionSigner(ADMIN).csrf_token(other)})
        assert r.status_code == 403
        r = await gw.client.post(url, data={"limit_usd": "3", "csrf": csrf, "back": back},
                                 headers={"Origin": "https://evil.example"})
        assert r.status_code == 403
        with gw.session_factory() as s:
            assert s.get(BudgetPolicyRow, f"tenant:{gw.tenant_id}") is None  # nothing was written
        r = await gw.client.post(url, data={"limit_usd": "3", "period": "", "csrf": csrf, "back": back})
        assert r.status_code == 303 and r.headers["location"] == back
        r = await gw.client.post(url, data={"limit_usd": "3", "csrf": csrf, "back": "https://evil.example/x"})
        assert r.status_code == 303 and r.headers["location"] == "/admin"  # back is allow-listed
        r = await gw.client.post(url, data={"limit_usd": "abc", "csrf": csrf, "back": back})
        assert r.status_code == 400 and "limit_usd" in r.text and "Action refused" in r.text
        # The JSON API with the cookie needs the header token as well.
        r = await gw.client.post("/admin/api/tenants", json={"name": "via-cookie"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_csrf"
        r = await gw.client.post("/admin/api/tenants", json={"name": "via-cookie"}, headers={"X-CSRF-Token": csrf})
        assert r.status_code == 201
        r = await gw.client.post("/admin/actions/tenants", data={"name": "via-form", "csrf": csrf})
        assert r.status_code == 303
        with gw.session_factory() as s:
            names = set(s.scalars(sa.select(Tenant.name)))
        assert {"via-cookie", "via-form"} <= names
        rows = audit_rows(gw)
        assert rows and all(a.actor.startswith("session:") and a.client for a in rows)
        assert (await gw.client.get("/admin/actions/tenants")).status_code == 405  # no state-changing GET


async def test_form_creates_key_shown_once_and_revokes(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        csrf = await _session(gw)
        r = await gw.client.post(f"/admin/actions/tenants/{gw.tenant_id}/keys", data={"name": "web", "csrf": csrf})
        assert r.status_code == 200 and "shown only once" in r.text
        secret = re.search(r'data-testid="new-key">([^<]+)<', r.text).group(1)  # type: ignore[union-attr]
        key_id = re.search(r'data-testid="new-key-id">([^<]+)<', r.text).group(1)  # type: ignore[union-attr]
        assert (await gw.client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})).status_code == 200
        page = (await gw.client.get(f"/admin/tenants/{gw.tenant_id}")).text
        assert secret not in page and f'data-key="{key_id}"' in page
        r = await gw.client.post(f"/admin/actions/keys/{key_id}/revoke", data={"csrf": csrf})
        assert r.status_code == 303
        assert (await gw.client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})).status_code == 401


async def test_admin_actions_are_throttled(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    now = [0.0]
    limiter = ActionLimiter(max_actions=3, window_s=60, clock=lambda: now[0])
    assert [limiter.take("a") for _ in range(3)] == [None, None, None]
    assert limiter.take("a") == 60 and limiter.take("b") is None
    now[0] = 61
    assert limiter.take("a") is None
    async with gateway(tmp_path, upstream) as gw:
        gw.app.state.admin_action_limiter = ActionLimiter(max_actions=2, window_s=60)
        for i in range(2):
            assert (await gw.client.post("/admin/api/tenants", json={"name": f"t{i}"}, headers=BEARER)).status_code == 201
        r = await gw.client.post("/admin/api/tenants", json={"name": "t3"}, headers=BEARER)
        assert r.status_code == 429 and "retry-after" in r.headers and r.json()["error"]["type"]


async def test_overview_lists_the_biggest_spenders_and_flagged_tenants(tmp_path: Path,
                                                                      upstream: ScriptedUpstream) -> None:
    from gateway.db.queries import create_tenant

    async with gateway(tmp_path, upstream) as gw:
        with gw.session_factory.begin() as s:
            quiet = create_tenant(s, "quiet co").id
            alerted = create_tenant(s, "alerted co").id
            s.add(BudgetAlertRow(id="alert_q", subject=f"tenant:{alerted}", tenant_id=alerted, period_key="2026-12",
                                 threshold_permille=500, spent_usd=Decimal(1), limit_usd=Decimal(2),
                                 created_at=datetime.now(UTC), attempts=0))
        seed(gw, gw.tenant_id, 2)
        await _session(gw)
        page = (await gw.client.get("/admin?shown=1")).text
        assert f'data-tenant="{gw.tenant_id}"' in page and f'data-tenant="{alerted}"' in page  # top spender, flagged
        assert f'data-tenant="{quiet}"' not in page and "2 of 3" in page and 'data-testid="all-tenants"' in page
        page = (await gw.client.get("/admin?shown=3")).text
        assert f'data-tenant="{quiet}"' in page and 'data-testid="all-tenants"' not in page
        assert len((await gw.client.get("/admin/api/overview", headers=BEARER)).json()["tenants"]) == 3


async def test_csv_exports_equal_the_database(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    import csv
    import io

    from tests.gateway.admin.admin_support import db_sums

    async with gateway(tmp_path, upstream) as gw:
        with gw.session_factory.begin() as s:
            s.execute(sa.update(Tenant).where(Tenant.id == gw.tenant_id).values(name="=HYPERLINK(1)"))
        # 30 hourly requests ending yesterday at 23:30 UTC: two UTC days whatever the time of the run
        # (from now, they spanned three days between midnight and 06:00 UTC)
        midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        seed(gw, gw.tenant_id, 30, start=midnight - timedelta(minutes=30))
        r = await gw.client.get("/admin/api/export/spend.csv?days=7", headers=BEARER)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
        rows = list(csv.DictReader(io.StringIO(r.text)))
        assert sum(Decimal(x["cost_usd"]) for x in rows) == db_sums(gw)[0]
        assert {x["tier"] for x in rows} == {"low", "high"} and len({x["day"] for x in rows}) == 2
        assert all(x["tenant"] == "'=HYPERLINK(1)" for x in rows)  # never a formula in a spreadsheet
        r = await gw.client.get(f"/admin/api/export/tenants/{gw.tenant_id}/keys.csv?days=7", headers=BEARER)
        keys = list(csv.DictReader(io.StringIO(r.text)))
        assert sum(Decimal(x["cost_usd"]) for x in keys) == db_sums(gw)[0]
        assert (await gw.client.get("/admin/api/export/spend.csv")).status_code == 401
        assert (await gw.client.get("/admin/api/export/tenants/ten_x/keys.csv", headers=BEARER)).status_code == 404


async def test_tenant_page_lists_batches_with_progress(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    from tests.gateway.jobs_support import create_batch, jobs_gateway, jsonl, line, upload, wait_final

    msgs = [{"role": "user", "content": "hi"}]
    async with jobs_gateway(tmp_path, upstream) as gw:
        f = (await upload(gw.client, gw.auth, jsonl([line(str(i), {"model": "low", "messages": msgs})
                                                     for i in range(3)]))).json()
        batch = (await create_batch(gw.client, gw.auth, f["id"])).json()
        final = await wait_final(gw.client, gw.auth, batch["id"])
        await _session(gw)
        page = (await gw.client.get(f"/admin/tenants/{gw.tenant_id}")).text
        table = page[page.index('data-testid="batches"'):]
        table = table[:table.index("</table>")]
        counts = final["request_counts"]
        assert batch["id"] in table and final["status"] in table
        assert f'<progress max="3" value="{counts["completed"] + counts["failed"]}">' in table


def test_svg_charts_escape_labels_and_scale_to_the_data() -> None:
    from gateway.admin import charts

    svg = charts.stacked_days(["2026-11-30", "2026-12-01"], {"high": [3.0, 0.0], "<x>": [1.0, 2.0]}, [8.0, 4.0],
                              label="a <b> chart")
    assert "<b>" not in svg and "a &lt;b&gt; chart" in svg and "&lt;x&gt;" in svg
    assert "<script" not in svg and "style=" not in svg  # the CSP allows neither
    bars = re.findall(r'<rect x="[\d.]+" y="([\d.]+)" width="[\d.]+" height="([\d.]+)" fill', svg)
    heights = sorted(float(h) for _, h in bars)
    assert heights[-1] == pytest.approx(3 * heights[0], rel=0.02)  # 3 vs 1 on one scale
    assert 'data-testid="baseline-line"' in svg
    assert charts.tier_sort(["xhigh", "high", "low", "medium", "zz"]) == ["low", "medium", "high", "xhigh", "zz"]
    assert "no spend" in charts.stacked_days([], {}, [], label="x")
    mix = charts.share_bar({"high": 1, "low": 3}, label="mix")
    widths = [float(w) for w in re.findall(r'<rect x="[\d.]+" y="0" width="([\d.]+)"', mix)]
    assert widths == pytest.approx([360.0, 120.0])  # low first, 75% of 480 px


def test_csrf_tokens_are_per_session() -> None:
    signer = SessionSigner("k")
    a, b = signer.issue(), signer.issue()
    assert signer.csrf_valid(a, signer.csrf_token(a)) and not signer.csrf_valid(b, signer.csrf_token(a))
    assert not SessionSigner("k2").csrf_valid(a, signer.csrf_token(a)) and not signer.csrf_valid(a, "")
    assert SessionSigner.session_id(a) != SessionSigner.session_id(b) and SessionSigner.session_id(a) not in a[-64:]


async def test_overview_shows_the_configured_default_budget(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        store = gw.app.state.tiergate.budgets.budgets.policies
        store._defaults = store.defaults.model_copy(update={"limit_usd": 2.0})  # budgets.limit_usd: 2.0
        seed(gw, gw.tenant_id, 2)
        body = (await gw.client.get("/admin/api/overview", headers=BEARER)).json()
        budget = body["tenants"][0]["budget"]
        assert budget["hard_limit_usd"] == 2.0 and budget["period"] == "month" and budget["spent_usd"] > 0
