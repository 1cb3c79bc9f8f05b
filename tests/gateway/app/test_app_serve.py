"""`tiergate serve --demo` set-up: migrate, create the demo tenant and key once (printed once),
and the printed examples name the key; `tiergate serve --help` lists the options."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from gateway.auth import KeyStore
from gateway.cli.serve import _demo_key, _print_demo
from gateway.db.session import make_engine, make_session_factory
from tests.gateway.scripted_upstream import config_for


def test_demo_key_is_created_once_and_works(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "demo.db"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(config_for("http://127.0.0.1:9/v1", db_url=f"sqlite:///{db}")))
    key = _demo_key(config)
    assert key is not None and key.startswith("tg-")
    assert _demo_key(config) is None  # second run: the tenant exists, no new key

    engine = make_engine(f"sqlite:///{db}")
    principal = asyncio.run(KeyStore(make_session_factory(engine)).authenticate(f"Bearer {key}"))
    engine.dispose()
    assert principal.key_prefix == key[:len(principal.key_prefix)]

    _print_demo("127.0.0.1", 8080, key)
    out = capsys.readouterr().out
    assert out.count(key) == 3  # announced once, then in the curl and the SDK examples
    assert "curl http://127.0.0.1:8080/v1/chat/completions" in out
    assert 'OpenAI(base_url="http://127.0.0.1:8080/v1"' in out
    _print_demo("127.0.0.1", 8080, None)
    assert key not in capsys.readouterr().out


def test_the_demo_says_how_to_run_the_cli_and_open_the_dashboard(capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TG_TEST_ADMIN", raising=False)
    _print_demo("127.0.0.1", 8080, None, "TG_TEST_ADMIN")
    out = capsys.readouterr().out
    assert ".venv/bin/activate" in out and "Admin dashboard: off" in out and "export TG_TEST_ADMIN=" in out
    monkeypatch.setenv("TG_TEST_ADMIN", "s3cret")
    _print_demo("127.0.0.1", 8080, None, "TG_TEST_ADMIN")
    out = capsys.readouterr().out
    assert "Admin dashboard: http://127.0.0.1:8080/admin (log in with the key in $TG_TEST_ADMIN)" in out
    assert "s3cret" not in out


def test_serve_help_lists_options() -> None:
    import typer

    from gateway.cli import serve

    app = typer.Typer()
    serve.register(app)

    @app.command()
    def _other() -> None:  # a second command so typer keeps `serve` as a subcommand
        pass

    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--config", "--host", "--port", "--workers", "--demo"):
        assert option in result.output


def _serve_app() -> typer.Typer:
    from gateway.cli import serve

    app = typer.Typer()
    serve.register(app)

    @app.command()
    def _other() -> None:  # a second command so typer keeps `serve` as a subcommand
        pass

    return app


def test_serve_refuses_several_workers_without_redis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.cli.serve import unshared_counters_refusal
    from gateway.settings import load_settings

    monkeypatch.delenv("TIERGATE_REDIS_URL", raising=False)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(config_for("http://127.0.0.1:9/v1", db_url=f"sqlite:///{tmp_path}/x.db")))
    result = CliRunner().invoke(_serve_app(), ["serve", "--config", str(config), "--workers", "3"])
    assert result.exit_code == 2  # refused before anything is served (no uvicorn is started)
    assert "--workers 3 refused" in result.output and "TIERGATE_REDIS_URL" in result.output
    assert "3x a budget" in result.output
    settings = load_settings(config)
    assert unshared_counters_refusal(settings, 1) is None  # one worker: counters in-process are exact
    monkeypatch.setenv("TIERGATE_REDIS_URL", "redis://127.0.0.1:1/0")
    assert unshared_counters_refusal(settings, 3) is None  # shared through Redis
