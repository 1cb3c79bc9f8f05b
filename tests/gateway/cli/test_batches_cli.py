"""`tiergate batches list|show|cancel` through typer's CliRunner on a real SQLite file: every
tenant's batches with their progress, one batch's bar with counts and an ETA, and cancel (pending
lines cancelled at once, the running one left to finish)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.cli import batches_cmd
from gateway.db.queries import create_tenant
from gateway.db.session import make_engine, make_session_factory
from gateway.jobs import store
from gateway.jobs.validate import LineSpec
from tests.gateway.cli_support import admin_cli_root


def test_batches_list_show_cancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, config = admin_cli_root(tmp_path, monkeypatch, "batches.db")
    root.add_typer(batches_cmd.app, name="batches")
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(root, [*args, "--config", str(config)])
        assert result.exit_code == 0, result.output
        return result.output

    run("db", "upgrade")
    engine = make_engine(f"sqlite:///{tmp_path / 'var' / 'batches.db'}")
    sf = make_session_factory(engine)
    t0 = store.utc_now() - timedelta(seconds=20)
    specs = [LineSpec(i, f"c{i}", {"model": "low", "messages": []}) for i in range(1, 6)]
    with sf() as s, s.begin():
        tenant_id = create_tenant(s, "acme").id
        batch_id = store.create_batch(s, tenant_id, None, "file-x", "/v1/chat/completions", "24h", None, specs, t0).id
    with sf() as s:
        ok, bad, running = store.claim_lines(s, now=t0, lease_s=600, limit=3)
    with sf() as s, s.begin():
        store.finish_line(s, ok, store.LineOutcome(200, {"object": "chat.completion"}), None, t0)
        store.finish_line(s, bad, store.LineOutcome(429, {"error": {}}, {"code": "budget_exceeded", "message": ""}),
                          None, t0)

    listed = run("batches", "list")
    assert batch_id in listed and "acme" in listed and "in_progress" in listed and "2/5" in listed

    shown = run("batches", "show", batch_id)
    assert f"{batch_id} [in_progress]" in shown and "2/5" in shown and "40%" in shown and "ETA 0:30" in shown  # 2 lines in 20 s, 3 left: 30 s
    assert "1 ok, 1 failed, 0 cancelled, 0 expired, 1 running, 2 pending" in shown
    view = json.loads(run("batches", "show", batch_id, "--json"))
    assert view["request_counts"] == {"total": 5, "completed": 1, "failed": 1}
    assert view["tenant"] == "acme" and 25 <= view["eta_s"] <= 35

    cancelled = run("batches", "cancel", batch_id)
    assert "cancelling" in cancelled and "2 cancelled, 1 still running" in cancelled
    with sf() as s:
        assert store.get_batch(s, tenant_id, batch_id).status == "cancelling"
    with sf() as s, s.begin():
        store.finish_line(s, running, store.LineOutcome(200, {}), None, t0)
    with sf() as s:
        assert store.finalize_if_done(s, batch_id, store.utc_now()) == "cancelled"
    shown = run("batches", "show", batch_id)
    assert "cancelled" in shown and "2 ok, 1 failed, 2 cancelled" in shown and "output file file-" in shown
    result = runner.invoke(root, ["batches", "cancel", batch_id, "--config", str(config)])
    assert result.exit_code == 1 and "Cannot cancel" in result.output
    result = runner.invoke(root, ["batches", "show", "batch_nope", "--config", str(config)])
    assert result.exit_code == 1 and "no batch" in result.output

    with sf() as s, s.begin():  # a line whose worker died: its lease ran out with no heartbeat
        stuck = store.create_batch(s, tenant_id, None, "file-y", "/v1/chat/completions", "24h", None, specs[:1], t0).id
    with sf() as s:
        store.claim_lines(s, now=t0, lease_s=5, limit=1, batch_id=stuck)
    assert "1 running line(s) lost their worker" in run("batches", "show", stuck)
    engine.dispose()
