"""Regressions from the security review's money-path findings: holds that price every choice and
the cap actually sent upstream (item 2), strict scalar types (item 10), and the budget and billing
details (item 12): soft-only budgets, a model named directly billed at its own price, the tier
header after the soft-budget cap, ``x-should-retry: false`` on budget 429s, and budget refusals
of a stream before its first byte. Each failed on the code before the fix."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from gateway.chat.request import ChatRequest
from gateway.money import nanos_to_decimal
from gateway.routing import NO_PREFS
from gateway.runtime import Runtime
from tests.gateway.gateway_harness import Gateway, gateway
from tests.gateway.scripted_upstream import ADMIN_KEY, ScriptedUpstream

pytestmark = pytest.mark.usefixtures("admin_key")
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MSGS = [{"role": "user", "content": "hello there"}]


async def _budget(gw: Gateway, **policy: Any) -> None:
    r = await gw.client.put(f"/admin/budgets/tenants/{gw.tenant_id}", headers=ADMIN,
                            json={"period": "day", **{k: str(v) for k, v in policy.items()}})
    assert r.status_code == 200, r.text


async def _worst_case(gw: Gateway, body: dict[str, Any]) -> Decimal:
    state: Runtime = gw.app.state.tiergate

    class Who:
        tenant_id, key_id, allow_prompt_storage, routing = gw.tenant_id, None, False, NO_PREFS

    req, _ = await state.flow.prepare(Who(), body)
    assert isinstance(req, ChatRequest)
    return nanos_to_decimal(state.flow.admission.worst_case(req)[0])


async def test_the_tier_cap_is_what_goes_upstream_on_every_path(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        cap = gw.settings.tiers["low"].max_output_tokens
        for body in ({"model": "low"}, {"model": "tier-low", "max_tokens": 10**9},
                     {"model": "low", "max_completion_tokens": 2**31}, {"model": "auto", "reasoning_effort": "low"}):
            r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={**body, "messages": MSGS})
            assert r.status_code == 200, r.text
            sent = upstream.requests[-1].body
            asked = sent.get("max_completion_tokens", sent.get("max_tokens"))
            assert asked is not None and asked <= cap, (body, sent)
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "low", "max_tokens": 10**12, "messages": MSGS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


async def test_holds_price_every_choice(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        one = await _worst_case(gw, {"model": "low", "messages": MSGS})
        many = await _worst_case(gw, {"model": "low", "messages": MSGS, "n": 128})
        prompt_part = await _worst_case(gw, {"model": "low", "messages": MSGS, "max_tokens": 1}) - Decimal("2e-6")
        assert many - prompt_part == pytest.approx(128 * (one - prompt_part))
        await _budget(gw, limit_usd=one * 4)  # room for a few single choices, not for 128 of them
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "low", "messages": MSGS, "n": 128})
        assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded"
        assert upstream.requests == []
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={"model": "low", "messages": MSGS})
        assert r.status_code == 200


@pytest.mark.parametrize(("field", "value"), [("temperature", "0.5"), ("n", "2"), ("stream", "yes"),
                                              ("max_tokens", 10.5), ("n", 2.5), ("top_p", True), ("logprobs", 1),
                                              ("seed", "7"), ("stop", 5)])
async def test_scalars_are_strict(tmp_path: Path, upstream: ScriptedUpstream, field: str, value: object) -> None:
    async with gateway(tmp_path, upstream) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "low", "messages": MSGS, field: value})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and err["type"] == "invalid_request_error"
        assert err["code"] == "invalid_value"
    assert upstream.requests == []


async def test_a_soft_only_budget_caps_effort_alerts_and_shows(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        await _budget(gw, soft_limit_usd=Decimal("0.00001"))
        xhigh = {"model": "auto", "reasoning_effort": "xhigh", "messages": MSGS, "tiergate": {"pipeline": "off"}}
        first = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=xhigh)
        assert first.status_code == 200 and first.headers["x-tiergate-tier"] == "xhigh"
        status = (await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}", headers=ADMIN)).json()["status"]
        assert status["soft_exceeded"] and status["soft_limit_usd"] == pytest.approx(0.00001)
        assert status["hard_limit_usd"] is None and status["remaining_usd"] is None
        assert Decimal(str(status["spent_usd"])) > 0
        capped = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=xhigh)
        assert capped.status_code == 200
        cap = gw.settings.budgets.soft_effort_cap
        assert capped.headers["x-tiergate-tier"] == capped.headers["x-tiergate-effort"] == cap
        assert capped.headers["x-tiergate-effort-source"] == "budget_cap"
        await gw.app.state.tiergate.budgets.alerts.drain()
        alerts = (await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}/alerts", headers=ADMIN)).json()
        assert alerts["data"], alerts  # crossing the soft limit alerted


async def test_a_model_named_directly_is_billed_at_its_own_price(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        object.__setattr__(gw.settings.tiers["none"], "price", type(gw.settings.models["up-a"].price)(
            input=100.0, output=100.0))  # the first tier on up-a overrides its price
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={"model": "up-a", "messages": MSGS})
        assert r.status_code == 200
        (row,) = gw.ledger_rows()
        own = gw.settings.models["up-a"].price
        expected = (row.prompt_tokens * own.input + row.completion_tokens * own.output) / 1e6
        assert float(row.cost_usd) == pytest.approx(expected)


async def test_budget_refusals_say_not_to_retry(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    async with gateway(tmp_path, upstream) as gw:
        await _budget(gw, limit_usd=Decimal("0.000001"))
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={"model": "low", "messages": MSGS})
        assert r.status_code == 429 and r.headers["x-should-retry"] == "false"


async def test_a_stream_the_budget_refuses_is_refused_before_its_first_byte(tmp_path: Path,
                                                                           upstream: ScriptedUpstream) -> None:
    """A pipeline stream admitted (its first call's worst case fits) whose plan call's own hold
    does not: a JSON 429, not an error event after a 200."""
    async with gateway(tmp_path, upstream) as gw:
        body = {"model": "auto", "reasoning_effort": "high", "messages": MSGS, "stream": True,
                "tiergate": {"pipeline": "on"}}
        await _budget(gw, limit_usd=await _worst_case(gw, body) + Decimal("0.000000001"))
        async with gw.client.stream("POST", "/v1/chat/completions", headers=gw.auth, json=body) as r:
            content = await r.aread()
        assert r.status_code == 429, content[:300]
        assert r.headers["content-type"].startswith("application/json")
        assert b"budget_exceeded" in content and upstream.requests == []
