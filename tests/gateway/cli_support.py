"""Set-up shared by the CLI tests that drive `tiergate db|tenants|keys|...` through typer's
CliRunner against a real SQLite file. Test helpers only; imports the CLI sub-apps."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
import yaml

from gateway.cli import db_cmd, tenants


def admin_cli_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, db_file: str) -> tuple[typer.Typer, Path]:
    """A typer root with the `db`, `tenants` and `keys` sub-apps, and the path of a config.yaml
    (one local model on every tier) whose database is ``sqlite:///var/<db_file>``. The
    environment's database URL and config path are cleared so only that file counts."""
    monkeypatch.delenv("TIERGATE_DATABASE_URL", raising=False)
    monkeypatch.delenv("TIERGATE_CONFIG", raising=False)
    config = tmp_path / "config.yaml"
    tiers = {t: {"model": "m"} for t in ("none", "minimal", "low", "medium", "high", "xhigh")}
    config.write_text(yaml.safe_dump({"models": {"m": {"provider": "local", "model": "x"}}, "tiers": tiers,
                                      "database": {"default_url": f"sqlite:///var/{db_file}"}}))
    root = typer.Typer()
    root.add_typer(db_cmd.app, name="db")
    root.add_typer(tenants.tenants_app, name="tenants")
    root.add_typer(tenants.keys_app, name="keys")
    return root, config
