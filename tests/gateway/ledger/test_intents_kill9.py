"""kill -9 of `tiergate serve` while upstream calls are in flight: every call the upstream saw
has exactly one ledger row after the restart — the answered ones ``ok``, the ones cut by the
kill ``interrupted`` (settled from their journaled intents at the configured policy) — and the
budget counters, ``daily_spend`` and the ledger agree to the nano-dollar.

Before intents existed, a call in flight at the kill had no row at all (the row was written
when the call ended), so this test fails on that code at ``len(rows) == calls``."""

from __future__ import annotations

import math
import signal
import threading
import time
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
import yaml

from gateway.auth import generate_key, hash_key
from gateway.db import migrate
from gateway.db.models import DailySpend, LedgerEntryRow, LedgerIntentRow
from gateway.db.queries import add_api_key, create_tenant
from gateway.db.session import make_engine, make_session_factory
from gateway.providers.metering import count_prompt_tokens
from gateway.settings import ModelSettings
from tests.gateway.ledger.test_gateway_kill9 import _free_port, _start
from tests.gateway.scripted_upstream import ADMIN_KEY, Behaviour, ScriptedUpstream, config_for

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.integration]

MSGS = [{"role": "user", "content": "count to a hundred"}]
CAP = 100  # max_tokens of every request: the output cap each intent records


def _post(base: str, auth: dict[str, str], body: dict[str, object], errors: list[BaseException]) -> None:
    try:
        with httpx.Client(base_url=base, headers=auth, timeout=60) as client:
            if body.get("stream"):
                with client.stream("POST", "/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass
            else:
                client.post("/chat/completions", json=body)
    except httpx.HTTPError as exc:  # the gateway was killed under it
        errors.append(exc)


@pytest.mark.parametrize("policy", ["estimate", "reserved"])
def test_kill9_mid_call_bills_each_upstream_call_exactly_once(tmp_path: Path, upstream: ScriptedUpstream,
                                                              admin_key: str, policy: str) -> None:
    db_url = f"sqlite:///{tmp_path / 'gw.db'}"
    cfg = config_for(upstream.base_url, db_url=db_url, journal_dir="journal", timeout_s=60, max_retries=0)
    cfg["ledger"]["flush_interval_ms"] = 20
    cfg["ledger"]["interrupted_billing"] = policy
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    sf = make_session_factory(engine)
    raw = generate_key()
    with sf() as s, s.begin():
        tenant = create_tenant(s, "acme")
        tenant_id = tenant.id
        add_api_key(s, tenant.id, raw, hash_key(raw))
    auth = {"Authorization": f"Bearer {raw}"}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    port, log = _free_port(), tmp_path / "serve.log"
    root = f"http://127.0.0.1:{port}"
    base = root + "/v1"

    proc = _start(config, port, log)
    try:
        r = httpx.put(f"{root}/admin/budgets/tenants/{tenant_id}", headers=admin,
                       json={"period": "month", "limit_usd": 100})
        assert r.status_code == 200, r.text
        with httpx.Client(base_url=base, headers=auth, timeout=30) as client:
            for i in range(3):  # answered before the kill: billed ok
                r = client.post("/chat/completions", json={"model": "low", "messages": MSGS, "max_tokens": CAP,
                                                           "stream": i == 1})
                assert r.status_code == 200, r.text
        answered = len(upstream.requests)
        # In flight at the kill, each started once the one before reached the upstream: blocked
        # non-streamed calls, a stream blocked before its first chunk, one that stalls after
        # streaming a few words, and a pipeline's stage call.
        plan: list[tuple[Behaviour, dict[str, object]]] = [
            (Behaviour(block=True), {"model": "low", "messages": MSGS, "max_tokens": CAP}),
            (Behaviour(block=True), {"model": "medium", "messages": MSGS, "max_tokens": CAP}),
            (Behaviour(block=True), {"model": "low", "messages": MSGS, "max_tokens": CAP, "stream": True}),
            (Behaviour(stall_after=3), {"model": "low", "messages": MSGS, "max_tokens": CAP, "stream": True}),
            (Behaviour(block=True), {"model": "low", "messages": MSGS, "max_tokens": CAP,
                                     "tiergate": {"pipeline": "on"}}),
        ]
        bodies = [b for _, b in plan]
        direct = 4
        errors: list[BaseException] = []
        threads = []
        for behaviour, body in plan:
            upstream.push(behaviour)
            seen = len(upstream.requests)
            t = threading.Thread(target=_post, args=(base, auth, body, errors), daemon=True)
            t.start()
            threads.append(t)
            assert upstream.wait_for(lambda up, n=seen: len(up.requests) == n + 1, 30), log.read_text()[-3000:]
        time.sleep(0.2)  # the stalled stream's first words reach the gateway
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    for t in threads:
        t.join(10)
    calls = len(upstream.requests)
    assert calls == answered + len(bodies)

    proc = _start(config, port, log)  # replays the journal, then settles the dead process's intents
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with sf() as s:
                n_rows = s.scalar(sa.select(sa.func.count()).select_from(LedgerEntryRow))
                n_intents = s.scalar(sa.select(sa.func.count()).select_from(LedgerIntentRow))
            if n_rows >= calls and n_intents == 0:
                break
            time.sleep(0.1)
        status = httpx.get(f"{root}/admin/budgets/tenants/{tenant_id}", headers=admin).json()["status"]
        health = httpx.get(f"{root}/readyz").json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    with sf() as s:
        rows = list(s.scalars(sa.select(LedgerEntryRow)))
        daily = s.scalar(sa.select(sa.func.coalesce(sa.func.sum(DailySpend.cost_usd), 0)))
        daily_calls = s.scalar(sa.select(sa.func.coalesce(sa.func.sum(DailySpend.requests), 0)))
        intents_left = s.scalar(sa.select(sa.func.count()).select_from(LedgerIntentRow))
    engine.dispose()

    assert len(rows) == calls, [(r.status, r.request_id) for r in rows]  # none lost, none doubled
    assert len({r.id for r in rows}) == calls
    assert intents_left == 0
    statuses = sorted(r.status for r in rows)
    assert statuses == ["interrupted"] * len(bodies) + ["ok"] * answered
    model = ModelSettings.model_validate(cfg["models"]["up-a"])
    prompt = count_prompt_tokens(model, MSGS)
    out = CAP if policy == "reserved" else math.ceil(CAP * 0.5)
    cut = [r for r in rows if r.status == "interrupted"]
    assert sorted(r.stage for r in cut) != ["direct"] * len(bodies)  # the pipeline's stage call too
    assert [r.stage for r in cut].count("direct") == direct
    for row in (r for r in cut if r.stage == "direct"):
        assert (row.prompt_tokens, row.completion_tokens) == (prompt, out)
        assert row.cost_usd == (Decimal(prompt) * 1 + Decimal(out) * 2) / 1_000_000  # up-a: $1 / $2 per 1M
    for row in (r for r in cut if r.stage != "direct"):  # priced from its own intent: its stage's cap
        assert row.prompt_tokens > 0 and row.completion_tokens > 0 and row.cost_usd > 0
    ledger_sum = sum((r.cost_usd for r in rows), Decimal(0))
    assert daily == ledger_sum and daily_calls == calls
    assert Decimal(str(status["spent_usd"])) == ledger_sum  # the budget counter: the ledger's sum
    assert health["ledger_state"]["interrupted_settled"] == len(bodies)
    assert health["ledger_state"]["owners_to_settle"] == 0
    owners = [p.name for p in (tmp_path / "journal" / ".owners").iterdir()]
    assert owners == []  # the dead owner settled and removed, the restarted one stopped cleanly
