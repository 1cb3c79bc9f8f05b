"""The pipeline behind the real chat route (SQLite, real ledger and key store, real registry and
router) with scripted local models: the response's tiergate object, usage and headers agree with
the ledger rows; streaming sends progress then the answer; explicit tier names stay direct."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson

from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.ledger import Ledger
from gateway.providers.registry import ProviderRegistry
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from tests.gateway.gateway_harness import Gateway, asgi_client, make_database
from tests.gateway.scripted_models import ScriptedProvider, plan_json, scripted_settings

MSGS = [{"role": "user", "content": "Compute 17*23 and then add 5."}]
PLAN = plan_json(("s1", "multiply", []), ("s2", "add five", ["s1"]))


@asynccontextmanager
async def pipeline_gateway(tmp_path: Path, provider: ScriptedProvider,
                           soft_exceeded: bool | None = None) -> AsyncIterator[Gateway]:

    url, sf, tenant_id, raw = make_database(tmp_path)
    base = scripted_settings().model_dump(exclude={"base_dir"})
    settings = settings_from_dict({**base, "database": {"default_url": url}}, base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    registry = ProviderRegistry(settings, local_provider=provider)
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf), registry=registry))
    try:
        async with asgi_client(app) as client:
            if soft_exceeded is not None:  # the caller's soft-budget state, as the admission reads it
                async def soft(_: object) -> bool:
                    return soft_exceeded
                app.state.tiergate.flow.admission.soft_exceeded = soft
            yield Gateway(app, client, settings, None, ledger, sf, tenant_id, raw)  # type: ignore[arg-type]
    finally:
        ledger.stop()


def _events(raw: bytes) -> list[Any]:
    return [orjson.loads(b[6:]) for b in raw.split(b"\n\n") if b.startswith(b"data: ") and b != b"data: [DONE]"]


async def test_pipeline_response_headers_and_ledger_agree(tmp_path: Path) -> None:
    provider = ScriptedProvider(plans=[PLAN], reviews=["VERDICT: accept\nANSWER:\n396"])
    async with pipeline_gateway(tmp_path, provider) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "auto", "reasoning_effort": "high", "messages": MSGS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == "396" and body["model"] == "auto"
        assert [s["stage"] for s in body["tiergate"]["stages"]] == ["plan", "execute", "execute", "review"]
        rows = gw.ledger_rows()
        assert sorted(r.stage for r in rows) == ["execute", "execute", "plan", "review"]
        assert {r.request_id for r in rows} == {body["id"]}
        assert sum(r.prompt_tokens for r in rows) == body["usage"]["prompt_tokens"]
        assert sum(r.completion_tokens for r in rows) == body["usage"]["completion_tokens"]
        cost = sum(r.cost_usd for r in rows)
        saved = sum(r.baseline_cost_usd for r in rows) - cost
        assert Decimal(r.headers["x-tiergate-cost-usd"]) == cost  # exact: integer nano-USD end to end
        assert Decimal(r.headers["x-tiergate-saved-usd"]) == saved
        assert r.headers["x-tiergate-effort"] == "high"
        (req,) = gw.request_rows()
        assert req.pipeline is True and req.cost_usd == cost


async def test_pipeline_streams_progress_then_answer_through_the_route(tmp_path: Path) -> None:
    provider = ScriptedProvider(plans=[PLAN], reviews=["VERDICT: accept\nANSWER:\n396"])
    async with pipeline_gateway(tmp_path, provider) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
            "model": "auto", "reasoning_effort": "high", "messages": MSGS, "stream": True,
            "stream_options": {"include_usage": True}})
        assert r.headers["x-tiergate-effort"] == "high"
        events = _events(r.content)
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
        assert any("reasoning_content" in d for d in deltas[:first_content])
        assert not any("reasoning_content" in d for d in deltas[first_content:])
        assert "".join(d.get("content") or "" for d in deltas) == "396"
        rows = gw.ledger_rows()
        assert events[-1]["usage"]["completion_tokens"] == sum(r.completion_tokens for r in rows)
        assert len(rows) == 4


async def test_explicit_tier_name_is_a_plain_direct_call_unless_pipeline_on(tmp_path: Path) -> None:
    provider = ScriptedProvider(plans=[PLAN])
    async with pipeline_gateway(tmp_path, provider) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={"model": "tier-high", "messages": MSGS})
        assert r.status_code == 200 and provider.roles() == ["direct"]
        assert "tiergate" not in provider.calls[0].body
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
            "model": "tier-low", "messages": MSGS, "tiergate": {"pipeline": "on"}})
        assert r.status_code == 200 and provider.roles()[1:] == ["plan", "step", "step", "review"]


async def test_auto_low_effort_is_one_bounded_direct_call(tmp_path: Path) -> None:
    provider = ScriptedProvider()
    async with pipeline_gateway(tmp_path, provider) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
            "model": "auto", "reasoning_effort": "medium", "verbosity": "low", "messages": MSGS})
        assert r.status_code == 200
        (call,) = provider.calls
        assert call.model == "scripted/mid" and call.body["max_tokens"] == 32 + 64
        assert "verbosity" not in call.body and "reasoning_effort" not in call.body
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={
            "model": "auto", "reasoning_effort": "high", "messages": MSGS, "tiergate": {"pipeline": "sometimes"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tiergate.pipeline"


async def test_tenant_past_soft_budget_gets_capped_effort_not_an_error(tmp_path: Path) -> None:
    provider = ScriptedProvider()
    async with pipeline_gateway(tmp_path, provider, soft_exceeded=True) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "auto", "reasoning_effort": "xhigh", "messages": MSGS})
        assert r.status_code == 200
        assert r.headers["x-tiergate-effort"] == "medium"  # settings.budgets.soft_effort_cap
        assert r.headers["x-tiergate-effort-source"] == "budget_cap"
        assert [(c.role, c.model) for c in provider.calls] == [("direct", "scripted/mid")]
        (row,) = gw.ledger_rows()
        assert row.tier == "medium"
        (req,) = gw.request_rows()
        assert (req.tier, req.effort_source, req.pipeline) == ("medium", "budget_cap", False)


async def test_review_verdict_becomes_classifier_feedback(tmp_path: Path) -> None:
    provider = ScriptedProvider(plans=[PLAN], reviews=["VERDICT: revise\nFAILING: s2\nANSWER:\nx",
                                                       "VERDICT: accept\nANSWER:\n396"])
    async with pipeline_gateway(tmp_path, provider) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "auto", "reasoning_effort": "high", "messages": MSGS})
        assert r.status_code == 200
        (fb,) = await gw.feedback_rows()
        assert (fb.request_id, fb.source, fb.label_tier) == (r.json()["id"], "review", "medium")
        assert fb.prompt_text is None and fb.features  # the tenant did not allow prompt storage
