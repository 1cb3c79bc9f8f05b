"""`tiergate budgets set|show` through typer's CliRunner on a real, migrated SQLite file, and the
policy a running gateway then reads from the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.budgets import PolicyStore
from gateway.cli import budgets_cmd
from gateway.db.session import database_url, make_engine, make_session_factory
from gateway.money import usd_to_nanos
from gateway.settings import load_settings
from tests.gateway.budgets_support import Caller
from tests.gateway.cli_support import admin_cli_root


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    root, config = admin_cli_root(tmp_path, monkeypatch, "b.db")
    root.add_typer(budgets_cmd.app, name="budgets")
    runner = CliRunner()

    def run(*args: str, code: int = 0):  # type: ignore[no-untyped-def]
        result = runner.invoke(root, [*args, "--config", str(config)])
        assert result.exit_code == code, result.output
        return result

    run("db", "upgrade")
    return run, config


async def test_set_show_and_the_gateway_reads_it(cli) -> None:  # type: ignore[no-untyped-def]
    run, config = cli
    run("tenants", "create", "acme")
    run("keys", "create", "--tenant", "acme")
    key_id = json.loads(run("keys", "list", "--json").stdout)[0]["id"]
    run("budgets", "set", "--tenant", "acme", "--period", "week", "--limit-usd", "12.5", "--alerts", "0.5,0.9",
        "--rpm", "60")
    run("budgets", "set", "--tenant", "acme", "--key", key_id, "--limit-usd", "2", "--tpm", "1000")
    shown = json.loads(run("budgets", "show", "--tenant", "acme", "--json").stdout)
    assert {s["subject"].split(":")[0] for s in shown} == {"tenant", "key"}
    tenant_row = next(s for s in shown if s["subject"].startswith("tenant:"))
    assert tenant_row["limit_usd"] == 12.5 and tenant_row["period"].startswith("week:") and tenant_row["spent_usd"] == 0

    settings = load_settings(config)
    engine = make_engine(database_url(settings))
    store = PolicyStore(make_session_factory(engine), settings.budgets)

    caller = Caller(tenant_row["subject"].split(":", 1)[1], key_id)
    tenant_policy, key_policy = await store.for_principal(caller)
    assert tenant_policy.limit_nanos == usd_to_nanos(12.5) and tenant_policy.alert_thresholds == (0.5, 0.9)
    assert tenant_policy.soft_limit_nanos == usd_to_nanos("10") and tenant_policy.requests_per_min == 60
    assert key_policy.limit_nanos == usd_to_nanos(2) and key_policy.period == "month" and key_policy.tokens_per_min == 1000
    engine.dispose()

    run("budgets", "set", "--tenant", "acme", "--clear", "limit_usd")
    assert json.loads(run("budgets", "show", "--tenant", "acme", "--json").stdout)[1]["limit_usd"] is None
    assert "period must be one of" in run("budgets", "set", "--tenant", "acme", "--period", "year", code=2).output
    assert "no tenant" in run("budgets", "set", "--tenant", "nope", "--limit-usd", "1", code=1).output
    assert "no API key" in run("budgets", "set", "--tenant", "acme", "--key", "key_x", "--limit-usd", "1",
                               code=1).output


def test_show_gives_the_effective_soft_limit_spent_held_remaining_and_used(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 15: `budgets show` printed ``soft_limit_usd=None`` where the gateway enforces 80% of
    the hard limit, and no remaining, % used or held."""
    from datetime import timedelta

    from gateway.budgets.periods import utc_now, window_for
    from gateway.db.models import BudgetReservationRow, DailySpend

    run, config = cli
    run("tenants", "create", "acme")
    run("budgets", "set", "--tenant", "acme", "--period", "day", "--limit-usd", "10")
    [row] = json.loads(run("budgets", "show", "--tenant", "acme", "--json").stdout)
    tenant_id = row["subject"].split(":", 1)[1]
    settings = load_settings(config)
    engine = make_engine(database_url(settings))
    now = utc_now()
    with make_session_factory(engine)() as s, s.begin():
        s.add(DailySpend(tenant_id=tenant_id, day=now.date(), model="up-a", tier="low", cost_usd=2.5, requests=1))
        s.add(BudgetReservationRow(id="res-1", tenant_id=tenant_id, key_id=None, request_id="r1",
                                   counters=[f"{row['subject']}|{window_for('day', now).key}"], amount_nanos=usd_to_nanos(1),
                                   status="held", created_at=now, expires_at=now + timedelta(minutes=5)))
    engine.dispose()
    [row] = json.loads(run("budgets", "show", "--tenant", "acme", "--json").stdout)
    assert row["limit_usd"] == 10 and row["soft_limit_usd"] == 8 and row["soft_limit_source"] != "set"
    assert row["spent_usd"] == 2.5 and row["held_usd"] == 1 and row["remaining_usd"] == 6.5
    assert row["used_pct"] == 25.0
    table = run("budgets", "show", "--tenant", "acme").stdout
    assert "$8 (default)" in table and "$6.5" in table and "25.0%" in table and "80% of the hard limit" in table


def test_keys_list_shows_tenant_names_and_spend(cli) -> None:  # type: ignore[no-untyped-def]
    """Issue 15: `keys list` showed tenant ids, not names, and no spend."""
    from decimal import Decimal

    from gateway.db.models import LedgerEntryRow

    run, config = cli
    run("tenants", "create", "acme")
    run("keys", "create", "--tenant", "acme", "--name", "ci")
    [key] = json.loads(run("keys", "list", "--json").stdout)
    engine = make_engine(database_url(load_settings(config)))
    with make_session_factory(engine)() as s, s.begin():
        for i, cost in enumerate(("0.25", "0.5")):
            s.add(LedgerEntryRow(id=f"row-{i}", request_id=f"req-{i}", tenant_id=key["tenant_id"], key_id=key["id"],
                                 stage="direct", tier="low", model="up-a", cost_usd=Decimal(cost), status="ok"))
    engine.dispose()
    [key] = json.loads(run("keys", "list", "--json").stdout)
    assert key["tenant"] == "acme" and key["spent_month_usd"] == 0.75 and key["spent_total_usd"] == 0.75
    listing = run("keys", "list").stdout
    assert "acme" in listing and "0.75" in listing and key["tenant_id"] not in listing
