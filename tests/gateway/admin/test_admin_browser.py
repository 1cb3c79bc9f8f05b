"""The admin dashboard in a real browser: Debian's chromium driven by Playwright against the
app under uvicorn (SQLite, ledger rows written by the real Ledger). Logs in through the form
and checks the spend and savings shown equal the database's sums. Skips when
/usr/bin/chromium is absent, except under CI (CI=true), where that is a failure."""

from __future__ import annotations

import os
from decimal import Decimal
from pathlib import Path

import pytest

from tests.gateway.admin.admin_support import ADMIN, db_sums, seed
from tests.gateway.gateway_harness import served_gateway
from tests.gateway.scripted_upstream import ScriptedUpstream

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SCREENSHOT = "/tmp/tiergate-admin-dashboard.png"
OVERVIEW_SCREENSHOT = "/tmp/tiergate-admin-overview.png"

# One list: a second ``pytestmark =`` would replace this one (the browser mark was once lost so).
pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("admin_key")]


@pytest.fixture
def chromium() -> str:
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHROMIUM} is missing under CI; .ci/run should have installed it")
        pytest.skip(f"{CHROMIUM} not installed")
    return CHROMIUM


def test_dashboard_shows_the_database_sums(tmp_path: Path, upstream: ScriptedUpstream, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    with served_gateway(tmp_path, upstream) as (base, gw):
        seed(gw, gw.tenant_id, 6)
        cost, baseline = db_sums(gw)
        t_cost, t_base = db_sums(gw, gw.tenant_id)
        root = base.removesuffix("/v1")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(f"{root}/admin")
                assert page.url.endswith("/admin/login")
                page.fill("#admin_key", "not-the-key")
                page.click("button[type=submit]")
                assert page.text_content("[data-testid=login-error]") == "wrong admin key"
                page.fill("#admin_key", ADMIN)
                page.click("button[type=submit]")
                page.wait_for_url(f"{root}/admin")
                cookie = next(c for c in page.context.cookies() if c["name"] == "tiergate_admin")
                assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
                assert page.evaluate("document.cookie") == ""  # invisible to scripts
                assert page.text_content("[data-testid=spend]") == f"${cost:.6f}"
                assert page.text_content("[data-testid=savings]") == f"${baseline - cost:.6f}"
                assert Decimal(page.get_attribute("[data-testid=spend]", "data-exact") or "") == cost
                assert page.text_content("[data-testid=pipeline-share]") == "50.0%"
                page.screenshot(path=OVERVIEW_SCREENSHOT, full_page=True)
                page.click("text=acme")
                page.wait_for_selector("[data-testid=tenant-name]")
                assert page.text_content("[data-testid=spend]") == f"${t_cost:.6f}"
                assert page.text_content("[data-testid=savings]") == f"${t_base - t_cost:.6f}"
                assert page.text_content("[data-testid=pipeline-share]") == "50.0%"
                widths = page.eval_on_selector_all(".bar", "els => els.map(e => e.getBoundingClientRect().width)")
                assert widths == [60, 60]  # admin.js sized the tier-mix bars (3 high, 3 low)
                page.screenshot(path=SCREENSHOT, full_page=True)
            finally:
                browser.close()
