"""`tiergate db`, `tiergate tenants`, `tiergate keys` through typer's CliRunner on a real SQLite file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from gateway.auth import KeyStore, hash_key
from gateway.cli import db_cmd
from gateway.db.session import make_engine, make_session_factory
from gateway.errors import AuthenticationFailed
from tests.gateway.cli_support import admin_cli_root


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    root, config = admin_cli_root(tmp_path, monkeypatch, "admin.db")
    runner = CliRunner()

    def run(*args: str, ok: bool = True):  # type: ignore[no-untyped-def]
        result = runner.invoke(root, [*args, "--config", str(config)])
        if ok:
            assert result.exit_code == 0, result.output
        return result

    return run, tmp_path / "var" / "admin.db"


def test_db_upgrade_creates_the_sqlite_file_under_var(cli) -> None:  # type: ignore[no-untyped-def]
    run, db_file = cli
    assert "base" in run("db", "current").stdout
    out = run("db", "upgrade").stdout
    assert db_file.exists()
    current = run("db", "current").stdout.strip()
    assert current and "base" not in current and out.strip().endswith(f" at {current}")
    run("db", "downgrade", "base")
    assert "base" in run("db", "current").stdout


async def test_keys_create_list_revoke(cli, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    run, db_file = cli
    caplog.set_level(logging.DEBUG)
    run("db", "upgrade")
    assert "created tenant acme" in run("tenants", "create", "acme").stdout
    assert "duplicate" in run("tenants", "create", "acme", ok=False).output
    tenants_json = json.loads(run("tenants", "list", "--json").stdout)
    assert [t["name"] for t in tenants_json] == ["acme"]

    created = run("keys", "create", "--tenant", "acme", "--name", "ci")
    raw = created.stdout.strip()
    assert raw.startswith("tg-") and "\n" not in raw  # stdout carries the key and nothing else
    assert raw not in created.stderr

    listing = run("keys", "list", "--tenant", "acme").stdout
    assert raw[:12] in listing and raw not in listing
    keys_json = json.loads(run("keys", "list", "--json").stdout)
    assert len(keys_json) == 1 and keys_json[0]["prefix"] == raw[:12] and keys_json[0]["revoked_at"] == ""

    engine = make_engine(f"sqlite:///{db_file}")
    factory = make_session_factory(engine)
    with factory() as s:
        dump = "\n".join(str(tuple(r)) for r in s.execute(sa.text("SELECT * FROM api_keys")))
    assert raw not in dump and hash_key(raw) in dump
    store = KeyStore(factory)
    principal = await store.authenticate(f"Bearer {raw}")
    assert principal.tenant_id == tenants_json[0]["id"]

    assert "revoked key" in run("keys", "revoke", keys_json[0]["id"]).stdout
    assert json.loads(run("keys", "list", "--json").stdout)[0]["revoked_at"] != ""
    store.clear()
    with pytest.raises(AuthenticationFailed):
        await store.authenticate(f"Bearer {raw}")
    engine.dispose()
    assert raw not in caplog.text


def test_friendly_errors(cli) -> None:  # type: ignore[no-untyped-def]
    run, _ = cli
    assert "tiergate db upgrade" in run("tenants", "list", ok=False).output
    run("db", "upgrade")
    result = run("keys", "create", "--tenant", "' OR '1'='1", ok=False)
    assert result.exit_code == 1 and "no tenant" in result.output
    assert "no API key" in run("keys", "revoke", "key_does_not_exist", ok=False).output


def test_bad_config_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: {}\ntiers: {}\n")
    result = CliRunner().invoke(db_cmd.app, ["upgrade", "--config", str(bad)])
    assert result.exit_code == 2 and "tiers" in result.output


async def test_tenant_routing_targets_reach_the_principal(cli) -> None:  # type: ignore[no-untyped-def]
    run, db_file = cli
    run("db", "upgrade")
    run("tenants", "create", "acme")
    raw = run("keys", "create", "--tenant", "acme").stdout.strip()
    assert "not both" in run("tenants", "set", "acme", "--target-quality", "0.9", "--target-cost", "0.3",
                             ok=False).output
    assert "target quality >= 0.9" in run("tenants", "set", "acme", "--target-quality", "0.9").stdout
    assert json.loads(run("tenants", "list", "--json").stdout)[0]["target"] == "quality >= 0.9"
    store = KeyStore(make_session_factory(make_engine(f"sqlite:///{db_file}")))
    prefs = (await store.authenticate(f"Bearer {raw}")).routing
    assert (prefs.target_quality, prefs.target_cost, prefs.exploration) == (0.9, None, None)
    assert "target cost <= 0.25" in run("tenants", "set", "acme", "--target-cost", "0.25",
                                         "--exploration", "0.1").stdout
    assert "target default" in run("tenants", "set", "acme", "--default-target").stdout
    assert json.loads(run("tenants", "list", "--json").stdout)[0]["exploration"] == 0.1
