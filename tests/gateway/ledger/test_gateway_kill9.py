"""Whole-gateway kill -9: `tiergate serve` in a subprocess (SQLite in tmp, every tier on the
scripted upstream, the ledger's DB writes deliberately slow so answered requests live only in
the journal), K requests answered, one stream cut by the client, SIGKILL, restart → the ledger
holds exactly one row per upstream call with the right token sums, the cut stream billed as
cancelled with the tokens actually generated."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
import yaml

from gateway.auth import generate_key, hash_key
from gateway.db import migrate
from gateway.db.models import LedgerEntryRow, Request
from gateway.db.queries import add_api_key, create_tenant
from gateway.db.session import make_engine, make_session_factory
from tests.gateway.scripted_upstream import (
    Behaviour,
    ScriptedUpstream,
    config_for,
)

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.integration]

K = 12
MSGS = [{"role": "user", "content": "count"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TIERGATE_CONFIG": str(config)}
    proc = subprocess.Popen([sys.executable, "-c", "from gateway.cli import main; main()", "serve",
                             "--config", str(config), "--port", str(port)],
                            env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("gateway did not become ready:\n" + log.read_text()[-3000:])


def _journal_has(journal: Path, *needles: str) -> bool:
    for seg in journal.rglob("*.jsonl"):
        for line in seg.read_text(errors="replace").splitlines():
            if all(n in line for n in needles):
                return True
    return False


def test_kill9_loses_no_ledger_row(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    db_url = f"sqlite:///{tmp_path / 'gw.db'}"
    cfg = config_for(upstream.base_url, db_url=db_url, journal_dir="journal")
    cfg["ledger"]["durability"] = "process"  # the default: answers wait for write(2), fdatasync runs after
    cfg["ledger"]["flush_interval_ms"] = 60_000  # DB writes lag: only the journal can save the rows
    cfg["ledger"]["batch_size"] = 10_000
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    sf = make_session_factory(engine)
    raw = generate_key()
    with sf() as s, s.begin():
        tenant = create_tenant(s, "acme")
        add_api_key(s, tenant.id, raw, hash_key(raw))
    auth = {"Authorization": f"Bearer {raw}"}
    port, log = _free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}/v1"

    proc = _start(config, port, log)
    try:
        expected_completion = 0
        with httpx.Client(base_url=base, headers=auth, timeout=10) as client:
            for i in range(K):
                n = 1 + i % 5
                stream = i % 3 == 0
                r = client.post("/chat/completions", json={"model": "low", "messages": MSGS, "max_tokens": n,
                                                           "stream": stream})
                assert r.status_code == 200, r.text
                expected_completion += n
            upstream.push(Behaviour(chunk_delay_s=0.03, n_words=300))
            with client.stream("POST", "/chat/completions",
                               json={"model": "low", "messages": MSGS, "stream": True}) as r:
                cut_id = r.headers["x-request-id"]
                seen = 0
                for line in r.iter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 5:
                        break
            # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 15
        while not (upstream.disconnects and _journal_has(tmp_path / "journal", cut_id, '"cancelled"')):
            assert time.monotonic() < deadline, (
                f"the cut stream was not cancelled upstream ({upstream.disconnects}) and journaled: "
                + "".join(p.read_text()[-1500:] for p in (tmp_path / "journal").rglob("*.jsonl")) + log.read_text())
            time.sleep(0.05)
        with sf() as s:
            committed_before_kill = s.scalar(sa.select(sa.func.count()).select_from(LedgerEntryRow))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert committed_before_kill < K + 1  # the rows were not all in the DB yet: replay must restore them

    cfg["ledger"]["flush_interval_ms"] = 20  # the restarted gateway commits promptly
    config.write_text(yaml.safe_dump(cfg))
    proc = _start(config, port, log)  # replays the journal on start
    try:
        calls = len(upstream.requests)
        assert calls == K + 1
        deadline = time.monotonic() + 30
        rows: list[LedgerEntryRow] = []
        while time.monotonic() < deadline:
            with sf() as s:
                rows = list(s.scalars(sa.select(LedgerEntryRow)))
            if len(rows) >= calls:
                break
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    with sf() as s:
        rows = list(s.scalars(sa.select(LedgerEntryRow)))
        requests = {r.id: r for r in s.scalars(sa.select(Request))}
    engine.dispose()
    assert len(rows) == calls  # exactly one row per upstream call: none lost, none doubled
    assert len({r.id for r in rows}) == calls
    answered = [r for r in rows if r.request_id != cut_id]
    assert all(r.status == "ok" for r in answered)
    assert sum(r.completion_tokens for r in answered) == expected_completion
    assert sum(r.prompt_tokens for r in answered) == 11 * K
    (cut,) = [r for r in rows if r.request_id == cut_id]
    assert cut.status == "cancelled"
    assert 3 <= cut.completion_tokens < 300  # billed for what was generated before the cut
    assert requests[cut_id].status == "cancelled"
    assert sum(1 for r in requests.values() if r.status == "ok") == K
