"""Every pipeline call is covered by a budget hold: the pipeline holds each call's worst case on
the tenant's budget before making it and settles it to that call's ledger rows; a refused hold
mid-pipeline stops early with the best answer so far (a refusal before anything was produced is
the 429 ``budget_exceeded``); N concurrent pipeline requests never push spend past a hard limit,
and the spend counter equals the ledger. Also: the tenant's ``allow_prompt_storage`` reaches the
review feedback (text stored only when allowed)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.budget_execution import BudgetedExecutor
from gateway.budgets import to_nanos, worst_case_cost
from gateway.db.models import Feedback, Tenant
from gateway.errors import BudgetExceeded
from gateway.execution import ResolvedRequest
from gateway.pipeline import RequestContext
from gateway.providers.base import CallOptions
from gateway.providers.metering import count_prompt_tokens
from gateway.resolve import resolve_model
from gateway.routing import direct_body, resolve_execution
from tests.gateway.scripted_models import ScriptedProvider, harness, plan_json, scripted_settings
from tests.gateway.test_pipeline_app import pipeline_gateway

ADMIN = "admin-secret-for-pipeline-budget-tests"
CTX = RequestContext(request_id="chatcmpl-h", tenant_id="t1", key_id="k1")
MSGS = [{"role": "user", "content": "Explain it step by step."}]
PLAN = plan_json(("s1", "first", []), ("s2", "second", ["s1"]))
HIGH = {"model": "auto", "reasoning_effort": "high", "messages": MSGS}


@dataclass
class ScriptedHold:
    budget: ScriptedBudget
    worst_nanos: int
    settled: int | None = None

    async def settle(self, cost_nanos: int) -> None:
        assert self.settled is None, "a hold is settled once"
        self.settled = cost_nanos
        self.budget.open -= 1


@dataclass
class ScriptedBudget:
    """A ``CallBudget`` that grants the first ``grant`` holds and refuses the rest (429)."""

    grant: int
    metered: bool = False
    open: int = 0
    holds: list[ScriptedHold] = field(default_factory=list)

    async def meter_per_call(self) -> None:
        self.metered = True

    async def hold(self, worst_case_usd: float) -> ScriptedHold:
        if len(self.holds) >= self.grant:
            raise BudgetExceeded("tenant budget exhausted for this month period")
        hold = ScriptedHold(self, to_nanos(worst_case_usd))
        self.holds.append(hold)
        self.open += 1
        return hold


async def _run(provider: ScriptedProvider, budget: ScriptedBudget, body: dict = HIGH):  # type: ignore[no-untyped-def,type-arg]
    h = harness(provider)
    h.pipeline.call_budget = budget
    result = await h.pipeline.run(CTX, body, resolve_execution(h.settings, body, None))
    return h, result


async def test_every_call_is_held_first_and_settled_to_its_ledger_rows() -> None:
    budget = ScriptedBudget(grant=100)
    h, result = await _run(ScriptedProvider(plans=[PLAN]), budget)
    assert result.stopped_early is None
    assert [e.stage for e in h.entries] == ["plan", "execute", "execute", "review"]
    assert len(budget.holds) == 4 and budget.open == 0
    for hold, entry in zip(budget.holds, h.entries, strict=True):
        assert hold.settled == to_nanos(entry.cost_usd) > 0
        assert hold.worst_nanos >= hold.settled  # the hold covered the call
    assert sum(h.settled or 0 for h in budget.holds) == sum(to_nanos(e.cost_usd) for e in h.entries)


async def test_budget_refusing_the_review_stops_early_with_the_steps_answer() -> None:
    budget = ScriptedBudget(grant=3)  # plan + two steps; the review is refused
    provider = ScriptedProvider(plans=[PLAN], step=lambda m, t: "STEP2" if "second" in t else "STEP1")
    h, result = await _run(provider, budget)
    assert [e.stage for e in h.entries] == ["plan", "execute", "execute"]
    assert "review" not in provider.roles()  # the refused call never reached the model
    assert result.answer.startswith("STEP2") and "budget cannot cover the next review call" in result.answer
    assert result.stopped_early is not None
    assert (result.stopped_early["reason"], result.stopped_early["stage"]) == ("budget", "review")
    assert result.tiergate_object()["stopped_early"]["reason"] == "budget"
    assert budget.open == 0 and h.verdicts == []


async def test_budget_refusing_before_anything_was_produced_is_a_429() -> None:
    for grant in (0, 1):  # the plan refused; the plan made but its only step refused
        budget = ScriptedBudget(grant=grant)
        provider = ScriptedProvider(plans=[plan_json(("s1", "only", []))])
        with pytest.raises(BudgetExceeded) as err:
            await _run(provider, budget)
        assert err.value.status == 429 and err.value.code == "budget_exceeded"
        assert provider.roles() == ["plan"] * grant and budget.open == 0


async def test_xhigh_paths_hold_one_each_and_a_refused_extra_path_just_runs_fewer() -> None:
    words = "a b c d e f g h i j k l 42"
    provider = ScriptedProvider(plans=[plan_json(("s1", "only", []))],
                                paths={i: (words, [-0.1] * 13) for i in range(3)})
    budget = ScriptedBudget(grant=3)  # plan + two of the three paths; the review is refused
    body = {**HIGH, "reasoning_effort": "xhigh"}
    h, result = await _run(provider, budget, body)
    assert [c.role for c in provider.calls] == ["plan", "step", "step"]  # 2 paths ran, not 3
    assert result.stopped_early is not None and result.stopped_early["stage"] == "review"
    assert result.answer.startswith(words) and budget.open == 0
    assert sum(h.settled or 0 for h in budget.holds) == sum(to_nanos(e.cost_usd) for e in h.entries)


async def _admin_put(gw, limit: Decimal) -> None:  # type: ignore[no-untyped-def]
    r = await gw.client.put(f"/admin/budgets/tenants/{gw.tenant_id}", headers={"Authorization": f"Bearer {ADMIN}"},
                            json={"period": "total", "limit_usd": str(limit)})
    assert r.status_code == 200, r.text


async def _status(gw) -> dict:  # type: ignore[no-untyped-def,type-arg]
    r = await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}", headers={"Authorization": f"Bearer {ADMIN}"})
    return r.json()["status"]  # type: ignore[no-any-return]


async def test_concurrent_pipelines_never_overspend_a_hard_budget(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_ADMIN_KEY", ADMIN)
    long_step = " ".join(["word"] * 60)
    revise = "VERDICT: revise\nFAILING: s1\nANSWER:\n" + " ".join(["draft"] * 40)
    provider = ScriptedProvider(plans=[PLAN], reviews=[revise], step=lambda m, t: long_step, step_delay_s=0.005)
    async with pipeline_gateway(tmp_path, provider) as gw:
        await _admin_put(gw, Decimal(1))
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=HIGH)
        assert r.status_code == 200, r.text
        one = Decimal(r.headers["x-tiergate-cost-usd"])  # one full pipeline: plan, steps, 3 reviews
        spent0 = Decimal(str((await _status(gw))["spent_usd"]))
        limit = spent0 + one * Decimal("3.5")
        await _admin_put(gw, limit)

        async def ask() -> tuple[int, dict]:  # type: ignore[type-arg]
            resp = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=HIGH)
            return resp.status_code, resp.json()

        results = await asyncio.gather(*(ask() for _ in range(12)))
        codes = [c for c, _ in results]
        assert set(codes) <= {200, 429}, results
        complete = [b for c, b in results if c == 200 and b["tiergate"]["stopped_early"] is None]
        stopped = [b for c, b in results if c == 200 and b["tiergate"]["stopped_early"] is not None]
        assert len(complete) <= 3  # 12 full pipelines would cost 12 × one; only 3.5 × one fits
        assert all(b["tiergate"]["stopped_early"]["reason"] == "budget" for b in stopped)
        assert all("budget cannot cover" in b["choices"][0]["message"]["content"] for b in stopped)
        assert all(b["error"]["code"] == "budget_exceeded" for c, b in results if c == 429)
        status = await _status(gw)
        spent = Decimal(str(status["spent_usd"]))
        assert status["held_usd"] == 0
        rows = gw.ledger_rows()
        assert sum((row.cost_usd for row in rows), Decimal(0)) == spent  # ledger == spend counter
        # Every call held its worst case (here never below its actual cost) before it ran, so
        # settled spend stays within the limit; the requirement is "overshoot ≤ one reservation".
        assert spent <= limit, (spent, limit)
        assert len(complete) < 12 and stopped  # the budget bound: some pipelines stopped early


async def _review_feedback(tmp_path: Path, allow: bool) -> Feedback:
    tmp_path.mkdir()
    provider = ScriptedProvider(plans=[PLAN])
    async with pipeline_gateway(tmp_path, provider) as gw:
        with gw.session_factory.begin() as s:
            s.execute(sa.update(Tenant).where(Tenant.id == gw.tenant_id).values(allow_prompt_storage=allow))
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=HIGH)
        assert r.status_code == 200, r.text
        for _ in range(200):  # the recorder writes on its own thread
            with gw.session_factory() as s:
                rows = list(s.scalars(sa.select(Feedback)))
            if rows:
                break
            await asyncio.sleep(0.02)
        (row,) = rows
        assert row.request_id == r.json()["id"] and row.source == "review" and row.features
        return row


async def test_review_feedback_keeps_prompt_text_only_when_the_tenant_allows(tmp_path: Path) -> None:
    denied = await _review_feedback(tmp_path / "no", allow=False)
    assert denied.prompt_text is None
    allowed = await _review_feedback(tmp_path / "yes", allow=True)
    assert allowed.prompt_text is not None and "Explain it step by step." in allowed.prompt_text


def test_admission_covers_a_thinking_calls_answer_plus_its_thinking_budget() -> None:
    settings = scripted_settings()
    body = {"model": "auto", "reasoning_effort": "medium", "messages": MSGS}
    resolution = resolve_model(settings, "auto", MSGS, reasoning_effort="medium")
    req = ResolvedRequest(request_id="r", tenant_id="t", key_id=None, resolution=resolution, body=body,
                          options=CallOptions())
    sent = direct_body(body, resolve_execution(settings, body, None))  # what the medium call may generate
    assert sent["max_tokens"] > settings.tiers["medium"].max_output_tokens
    worst, tokens = BudgetedExecutor(settings, None, None).worst_case(req)  # type: ignore[arg-type]
    prompt = count_prompt_tokens(settings.models["mid"], MSGS)
    assert worst >= worst_case_cost(settings, "medium", "mid", prompt, sent["max_tokens"])
    assert tokens >= prompt + sent["max_tokens"]
