"""Hard budgets hold against an upstream that always generates everything it may.

The scripted upstream here honours ``n`` and writes every choice to its ``max_tokens`` (or, when
the request sets none, as long as the model's context allows). 64 concurrent requests of one
tenant — every entry: a model named directly with no cap, a named tier with a huge
``max_tokens``, ``auto``, streams, the pipeline, batch lines — ask for up to 128 choices with no
or huge ``max_tokens``. The tenant's hard budget must never be passed: not by the ledger, not by
the budget counter, and nothing stays held. (On the old code the hold priced one completion, and a
named tier's cap was assumed by the hold but never sent upstream.)
"""

from __future__ import annotations

import asyncio
import random
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.db.models import LedgerEntryRow
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from tests.gateway.gateway_harness import Gateway, asgi_client, make_database
from tests.gateway.jobs_support import FINAL, batch_config, create_batch, jsonl, line, upload
from tests.gateway.scripted_upstream import ADMIN_KEY, ScriptedUpstream

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("admin_key")]

LIMIT = Decimal("0.02")
CONTEXT = 128  # every model's window: what an uncapped choice may fill
CAP = 16  # every tier's max_output_tokens


def _config(upstream: ScriptedUpstream, db_url: str) -> dict[str, Any]:
    cfg = batch_config(upstream.base_url, db_url, context_window=CONTEXT, jobs={"concurrency": 8})
    for tier in cfg["tiers"].values():
        tier["max_output_tokens"] = CAP
    cfg["pipeline"] = {"max_review_rounds": 0, "max_steps": 2}
    return cfg


def _request(rng: random.Random, i: int) -> dict[str, Any]:
    entry = i % 6
    n = rng.choice([1, 2, 16, 64, 128])
    huge = rng.choice([None, 10**9, 2**31])
    body: dict[str, Any] = {"messages": [{"role": "user", "content": f"write everything {i}"}], "n": n}
    if huge is not None:
        body[rng.choice(["max_tokens", "max_completion_tokens"])] = huge
    if entry == 0:
        body["model"] = "up-solo"  # named directly: no tier cap, the context window bounds it
    elif entry == 1:
        body["model"] = "tier-low"
    elif entry == 2:
        body["model"] = "auto"
    elif entry == 3:
        body.update(model="medium", stream=True, stream_options={"include_usage": True})
    elif entry == 4:
        body.update(model="auto", reasoning_effort="high", n=1)  # the pipeline (one choice only)
    else:
        body.update(model="auto", reasoning_effort="xhigh", n=1, stream=True)
    return body


async def _send(gw: Gateway, body: dict[str, Any]) -> int:
    r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=body)
    await r.aread()
    assert r.status_code in (200, 429), r.text[:300]
    if r.status_code == 429:
        assert r.json()["error"]["code"] == "budget_exceeded" and r.headers["x-should-retry"] == "false"
    return r.status_code


async def test_a_hard_budget_holds_against_an_upstream_that_writes_the_maximum(tmp_path: Path) -> None:
    with ScriptedUpstream(fill_max=True, fill_max_limit=CONTEXT - 20) as upstream:
        url, sf, tenant_id, raw = make_database(tmp_path)
        settings = settings_from_dict(_config(upstream, url), base_dir=tmp_path)
        ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
        ledger.start()
        app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf)))
        try:
            async with asgi_client(app) as client:
                gw = Gateway(app, client, settings, upstream, ledger, sf, tenant_id, raw)
                admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
                r = await client.put(f"/admin/budgets/tenants/{tenant_id}", headers=admin,
                                     json={"period": "day", "limit_usd": str(LIMIT)})
                assert r.status_code == 200, r.text
                rng = random.Random(7)
                lines = [line(f"b{i}", {k: v for k, v in _request(rng, i).items()
                                        if k not in ("stream", "stream_options")}) for i in range(16)]
                f = (await upload(client, gw.auth, jsonl(lines))).json()
                batch = (await create_batch(client, gw.auth, f["id"])).json()
                codes = await asyncio.gather(*(_send(gw, _request(rng, i)) for i in range(64)))
                for _ in range(1500):
                    batch = (await client.get(f"/v1/batches/{batch['id']}", headers=gw.auth)).json()
                    if batch["status"] in FINAL:
                        break
                    await asyncio.sleep(0.02)
                assert batch["status"] == "completed", batch
                status = (await client.get(f"/admin/budgets/tenants/{tenant_id}", headers=admin)).json()["status"]
                rows = gw.ledger_rows()
        finally:
            ledger.stop()
    assert 0 < codes.count(200) < 64 and codes.count(429) > 0  # the budget both admitted and refused
    assert upstream.requests and max(len(r.body.get("messages", [])) for r in upstream.requests) > 0
    assert max(int(r.body.get("n") or 1) for r in upstream.requests) > 1  # many choices did run
    spent = sum((row.cost_usd for row in rows), Decimal(0))
    assert 0 < spent <= LIMIT, (spent, LIMIT)
    assert Decimal(str(status["spent_usd"])) == spent and status["held_usd"] == 0
    with sf() as s:  # every row is the tenant's: nothing billed elsewhere
        assert s.scalar(sa.select(sa.func.count()).select_from(LedgerEntryRow)
                        .where(LedgerEntryRow.tenant_id != tenant_id)) == 0
