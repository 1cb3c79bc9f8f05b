"""The console's actions through a real browser (Debian's chromium under Playwright, the app under
uvicorn): create a tenant, create and revoke a key, set and raise a budget, set a key budget,
cancel a running batch — each through the page's forms — then check the database and a following
API call reflect it.
Then every page at 390, 1024 and 1440 px: the page never scrolls sideways
(``document.documentElement.scrollWidth <= innerWidth``); a full-page screenshot of each at
1440 px goes to ``$TIERGATE_SCREENSHOTS`` or ``var/screenshots/console`` (printed); with
``TIERGATE_SCREENSHOTS_ALL_WIDTHS=1`` also at 390 and 1024 px."""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from gateway.db.models import AdminAuditRow, ApiKey, BatchLine, BudgetAlertRow, BudgetPolicyRow, Tenant
from tests.gateway.admin.admin_support import ADMIN, seed
from tests.gateway.gateway_harness import served_gateway
from tests.gateway.jobs_support import jsonl, line
from tests.gateway.scripted_upstream import Behaviour, ScriptedUpstream

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
WIDTHS = (390, 1024, 1440)
REPO = Path(__file__).resolve().parents[3]
BEARER = {"Authorization": f"Bearer {ADMIN}"}

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("admin_key")]


@pytest.fixture
def chromium() -> str:
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHROMIUM} is missing under CI; .ci/run should have installed it")
        pytest.skip(f"{CHROMIUM} not installed")
    return CHROMIUM


def screenshot_dir() -> Path:
    out = Path(os.environ.get("TIERGATE_SCREENSHOTS") or REPO / "var" / "screenshots" / "console")
    out.mkdir(parents=True, exist_ok=True)
    return out


# After two animation frames (a resize's layout has settled): the page's scroll width, the viewport's
# width and, when the first is larger, the elements and text runs that stick out, for the message.
MEASURE = """async () => {
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const inner = window.innerWidth, scroll = document.documentElement.scrollWidth;
  const out = [];
  if (scroll > inner) {
    for (const e of document.querySelectorAll('body *')) {
      const right = e.getBoundingClientRect().right;
      if (right > inner + 0.5) out.push(e.tagName + '.' + e.className + '#' + (e.dataset.testid || '')
                                       + ' right=' + Math.round(right) + ' text=' + (e.textContent || '').slice(0, 60));
    }
    const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
    for (let n = walk.nextNode(); n; n = walk.nextNode()) {
      const range = document.createRange(); range.selectNodeContents(n);
      const right = range.getBoundingClientRect().right;
      if (right > inner + 0.5) out.push('text in ' + n.parentElement.tagName + ' right=' + Math.round(right)
                                       + ' text=' + n.textContent.slice(0, 60));
    }
  }
  return [scroll, inner, out.slice(-8)];
}"""


def check_layout(page: Any, name: str, shots: Path) -> None:
    """No sideways page scroll at any width, once the page has loaded (its stylesheet included: an
    element found in the DOM does not mean admin.css has arrived, and an unstyled page overflows —
    CI once measured 408 px at 390 with nothing sticking out a moment later) and the layout has
    settled after the resize (two animation frames; up to 5 tries 200 ms apart, so only a transient
    state passes); a 1440 px full-page screenshot."""
    page.wait_for_load_state("load")
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": 900})
        for _ in range(5):
            scroll, inner, wide = page.evaluate(MEASURE)
            if scroll <= inner:
                break
            page.wait_for_timeout(200)
        assert scroll <= inner, f"{name} overflows at {width} px: scrollWidth {scroll} > {inner}; widest: {wide}"
        if width != 1440 and os.environ.get("TIERGATE_SCREENSHOTS_ALL_WIDTHS"):
            page.screenshot(path=str(shots / f"{name}-{width}.png"), full_page=True)
    page.screenshot(path=str(shots / f"{name}-1440.png"), full_page=True)


def test_console_actions_and_layout(tmp_path: Path, upstream: ScriptedUpstream, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    shots = screenshot_dir()
    print(f"\nconsole screenshots: {shots}")
    with served_gateway(tmp_path, upstream) as (base, gw):
        root = base.removesuffix("/v1")
        seed(gw, gw.tenant_id, 40)
        with gw.session_factory.begin() as s:
            s.add(BudgetAlertRow(id="alert_b1", subject=f"tenant:{gw.tenant_id}", tenant_id=gw.tenant_id,
                                 period_key="2026-12", threshold_permille=500, spent_usd=Decimal("0.5"),
                                 limit_usd=Decimal(1), created_at=datetime.now(UTC), attempts=0))
        api = httpx.Client(base_url=root, headers=BEARER, timeout=10)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                page.goto(f"{root}/admin/login")
                check_layout(page, "login", shots)
                page.fill("#admin_key", ADMIN)
                page.click("button[type=submit]")
                page.wait_for_url(f"{root}/admin")

                # create a tenant
                page.fill("#tenant_name", "gamma labs")
                page.click("[data-testid=create-tenant] button[type=submit]")
                page.wait_for_url(f"{root}/admin")
                with gw.session_factory() as s:
                    gamma = s.scalars(sa.select(Tenant.id).where(Tenant.name == "gamma labs")).one()
                over = api.get("/admin/api/overview").json()
                assert "gamma labs" in {t["name"] for t in over["tenants"]}
                page.click("text=gamma labs")
                page.wait_for_selector("[data-testid=tenant-name]")
                assert page.url.startswith(f"{root}/admin/tenants/{gamma}")

                # create a key: the secret is shown once and works
                page.fill("#key_name", "browser key")
                page.click("[data-testid=create-key] button[type=submit]")
                secret = page.text_content("[data-testid=new-key]") or ""
                key_id = page.text_content("[data-testid=new-key-id]") or ""
                assert secret.startswith("tg-") or len(secret) > 20
                check_layout(page, "key-created", shots)
                v1 = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {secret}"}, timeout=10)
                assert v1.get("/models").status_code == 200
                page.click("[data-testid=back]")
                page.wait_for_selector(f"tr[data-key='{key_id}']")

                # revoke it
                page.click(f"tr[data-key='{key_id}'] button.danger")
                page.wait_for_selector(f"tr[data-key='{key_id}'] [data-testid=key-state]:has-text('revoked')")
                with gw.session_factory() as s:
                    assert s.get(ApiKey, key_id).revoked_at is not None  # type: ignore[union-attr]
                assert v1.get("/models").status_code == 401

                # set a budget, then raise it
                page.fill("[data-testid=budget-form] input[name=limit_usd]", "5")
                page.select_option("[data-testid=budget-form] select[name=period]", "month")
                page.click("[data-testid=budget-form] button[type=submit]")
                page.wait_for_selector("[data-testid=budget-limit]:has-text('$5.000000')")
                with gw.session_factory() as s:
                    assert s.get(BudgetPolicyRow, f"tenant:{gamma}").limit_usd == Decimal(5)  # type: ignore[union-attr]
                assert api.get(f"/admin/budgets/tenants/{gamma}").json()["status"]["hard_limit_usd"] == 5.0
                page.fill("[data-testid=budget-form] input[name=raise_by_usd]", "2.5")
                page.click("[data-testid=budget-form] button[type=submit]")
                page.wait_for_selector("[data-testid=budget-limit]:has-text('$7.500000')")
                with gw.session_factory() as s:
                    assert s.get(BudgetPolicyRow, f"tenant:{gamma}").limit_usd == Decimal("7.5")  # type: ignore[union-attr]
                assert api.get(f"/admin/budgets/tenants/{gamma}").json()["status"]["hard_limit_usd"] == 7.5

                # a key budget on a fresh key
                page.fill("#key_name", "capped")
                page.click("[data-testid=create-key] button[type=submit]")
                capped = page.text_content("[data-testid=new-key-id]") or ""
                page.click("[data-testid=back]")
                row = f"tr[data-key='{capped}']"
                page.fill(f"{row} input[name=limit_usd]", "1.25")
                page.select_option(f"{row} select[name=period]", "day")
                page.click(f"{row} button:has-text('Set')")
                page.wait_for_selector(f"{row} [data-testid=key-budget]:has-text('$1.250000/day')")
                with gw.session_factory() as s:
                    kb = s.get(BudgetPolicyRow, f"key:{capped}")
                    assert kb is not None and kb.limit_usd == Decimal("1.25") and kb.period == "day"
                assert api.get(f"/admin/budgets/keys/{capped}").json()["policy"]["limit_usd"] == 1.25
                audit = [a["action"] for a in api.get(f"/admin/api/audit?tenant_id={gamma}").json()["data"]]
                assert audit == ["budget.set", "key.create", "budget.raise", "budget.set", "key.revoke",
                                 "key.create", "tenant.create"]
                check_layout(page, "tenant-new", shots)

                # the other pages, at every width
                page.goto(f"{root}/admin")
                check_layout(page, "overview", shots)
                page.goto(f"{root}/admin/tenants/{gw.tenant_id}")
                page.wait_for_selector("[data-testid=chart-days]")
                check_layout(page, "tenant", shots)
                page.fill("[data-testid=budget-form] input[name=limit_usd]", "not money")
                page.click("[data-testid=budget-form] button[type=submit]")
                page.wait_for_selector("[data-testid=action-error]")
                check_layout(page, "action-error", shots)
            finally:
                browser.close()
    assert {p.name for p in shots.glob("*-1440.png")} >= {
        "login-1440.png", "overview-1440.png", "tenant-1440.png", "tenant-new-1440.png", "key-created-1440.png",
        "action-error-1440.png"}


def _line_states(gw: Any, batch_id: str) -> dict[str, int]:
    with gw.session_factory() as s:
        return dict(s.execute(sa.select(BatchLine.state, sa.func.count()).where(BatchLine.batch_id == batch_id)
                              .group_by(BatchLine.state)).tuples().all())


def test_console_cancels_a_running_batch(tmp_path: Path, upstream: ScriptedUpstream, chromium: str) -> None:
    """A 10-line batch with 4 lines in flight (the embedded runner's concurrency; the upstream holds
    them): Cancel on the tenant page makes it ``cancelling`` with the 6 lines not run cancelled;
    once the 4 answer it is ``cancelled`` with 4 completed, 0 failed, 10 total — in the database,
    in ``GET /v1/batches/{id}`` and on the page; the cancel is in the audit log."""
    from playwright.sync_api import sync_playwright

    shots = screenshot_dir()
    release = threading.Event()
    with served_gateway(tmp_path, upstream, timeout_s=30) as (base, gw):
        root = base.removesuffix("/v1")
        tenant_api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {gw.key}"}, timeout=10)
        admin_api = httpx.Client(base_url=root, headers=BEARER, timeout=10)
        try:
            upstream.push(*[Behaviour(hold_until=release) for _ in range(4)])
            content = jsonl([line(f"c{i}", {"model": "low", "messages": [{"role": "user", "content": f"q {i}"}]})
                             for i in range(10)])
            f = tenant_api.post("/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}).json()
            batch_id = tenant_api.post("/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                                         "completion_window": "24h"}).json()["id"]
            assert upstream.wait_for(lambda up: len(up.requests) >= 4), "the runner never started the batch"
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, args=ARGS)
                try:
                    page = browser.new_page(viewport={"width": 1440, "height": 900})
                    page.goto(f"{root}/admin/login")
                    page.fill("#admin_key", ADMIN)
                    page.click("button[type=submit]")
                    page.wait_for_url(f"{root}/admin")
                    page.goto(f"{root}/admin/tenants/{gw.tenant_id}")
                    row = f"tr[data-batch='{batch_id}']"
                    page.wait_for_selector(f"{row} [data-testid=batch-status]:has-text('in_progress')")
                    check_layout(page, "tenant-batch-running", shots)
                    page.click(f"{row} button:has-text('Cancel')")
                    page.wait_for_selector(f"{row} [data-testid=batch-status]:has-text('cancelling')")
                    assert page.locator(f"{row} [data-testid=batch-cancelled]").text_content() == "6"
                    assert page.locator(f"{row} form").count() == 0  # no second cancel
                    assert _line_states(gw, batch_id) == {"running": 4, "cancelled": 6}
                    got = tenant_api.get(f"/batches/{batch_id}").json()
                    assert got["status"] == "cancelling" and got["cancelling_at"]
                    assert got["request_counts"] == {"total": 10, "completed": 0, "failed": 0}
                    check_layout(page, "tenant-batch-cancelling", shots)

                    release.set()  # the 4 lines in flight answer; the batch becomes cancelled
                    for _ in range(500):
                        got = tenant_api.get(f"/batches/{batch_id}").json()
                        if got["status"] == "cancelled":
                            break
                        page.wait_for_timeout(20)
                    assert got["status"] == "cancelled" and got["cancelled_at"]
                    assert got["request_counts"] == {"total": 10, "completed": 4, "failed": 0}
                    assert _line_states(gw, batch_id) == {"done": 4, "cancelled": 6}
                    assert len(upstream.requests) == 4  # cancelled lines never reached the upstream
                    page.reload()
                    page.wait_for_selector(f"{row} [data-testid=batch-status]:has-text('cancelled')")
                    with gw.session_factory() as s:
                        audit = s.scalars(sa.select(AdminAuditRow).where(AdminAuditRow.action == "batch.cancel")).one()
                    assert audit.target == f"batch:{batch_id}" and audit.actor.startswith("session:")
                    listed = admin_api.get(f"/admin/api/audit?tenant_id={gw.tenant_id}").json()["data"]
                    assert listed[0]["action"] == "batch.cancel"
                    check_layout(page, "tenant-batches", shots)
                finally:
                    browser.close()
        finally:
            release.set()
    assert {"tenant-batch-running-1440.png", "tenant-batch-cancelling-1440.png", "tenant-batches-1440.png"} <= {
        p.name for p in shots.glob("*-1440.png")}
