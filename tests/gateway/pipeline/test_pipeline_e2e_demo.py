"""``make run``'s default config end to end: config.yaml as shipped (the bundled demo MoE on every
tier, in-process), the real app, ledger, key store and local engine. A high-effort request goes
through perceive → plan → execute → review on real tensors. Only the token budgets are shrunk
so that it runs in seconds on a CPU; models, tiers, prices and engine knobs are config.yaml's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.ledger import Ledger
from gateway.runtime import RuntimeParts
from gateway.settings import Settings, settings_from_dict
from tests.gateway.gateway_harness import make_database

ROOT = Path(__file__).resolve().parents[3]
# TIERGATE_TEST_DEMO_MODEL points the test at another build of the demo model (e.g. a fresh one).
DEMO = Path(os.environ.get("TIERGATE_TEST_DEMO_MODEL") or ROOT / "engine" / "models" / "demo-moe")
QUESTION = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]


def default_settings(db_url: str) -> Settings:
    raw: dict[str, Any] = yaml.safe_load((ROOT / "config.yaml").read_text(encoding="utf-8"))
    for tier in raw["tiers"].values():
        tier["max_output_tokens"] = 24
        if (tier.get("engine") or {}).get("thinking_budget_tokens"):
            tier["engine"]["thinking_budget_tokens"] = 48
    raw["pipeline"].update(max_steps=3, max_review_rounds=1)  # plan_fallback stays config.yaml's
    raw["database"] = {"default_url": db_url}
    raw["models"]["demo-moe"]["model"] = str(DEMO)
    return settings_from_dict(raw, base_dir=ROOT)


@pytest.mark.slow
@pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="the bundled demo model is not built yet")
async def test_default_config_pipeline_runs_all_four_stages_on_the_demo_model(tmp_path: Path) -> None:
    url, sf, _tenant, key = make_database(tmp_path)
    settings = default_settings(url)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf)))
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://tiergate", timeout=300) as client:
            r = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "auto", "reasoning_effort": "high", "temperature": 0,
                                        "messages": QUESTION})
    finally:
        ledger.stop()
    assert r.status_code == 200, r.text
    body = r.json()
    info = body["tiergate"]
    stages = [s["stage"] for s in info["stages"]]
    # the demo model cannot write plans: config.yaml's plan_fallback runs the request as one step
    assert info["plan_source"] in ("json", "list", "lines", "single_step"), info
    assert stages[0] == "plan" and "execute" in stages and stages[-1] == "review", stages
    assert {s["model"] for s in info["stages"]} == {"demo-moe"}
    assert {s["tier"] for s in info["stages"] if s["stage"] == "execute"} == {"low"}
    assert {s["tier"] for s in info["stages"] if s["stage"] != "execute"} == {"high"}
    assert body["usage"]["completion_tokens"] == sum(s["completion_tokens"] for s in info["stages"])
    assert float(r.headers["x-tiergate-cost-usd"]) == pytest.approx(info["cost_usd"], abs=1e-8)
    assert all(s["completion_tokens"] >= 1 and s["prompt_tokens"] > 0 for s in info["stages"])  # real counts
