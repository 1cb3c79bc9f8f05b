"""Every pipeline call is covered by a budget hold: the pipeline holds each call's worst case on
the tenant's budget before making it and settles it to that call's ledger rows; a refused hold
mid-pipeline stops early with the best answer so far (a refusal before anything was produced is
the 429 ``budget_exceeded``); N concurrent pipeline requests never push spend past a hard limit,
and the spend counter equals the ledger. Also: the tenant's ``allow_prompt_storage`` reaches the
review feedback (text stored only when allowed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.app import create_app
from gateway.auth import KeyStore
from gateway.budgets import build_budget_runtime, put_policy
from gateway.chat.admission import Admission, Admitted
from gateway.chat.request import ChatRequest
from gateway.chat.spend import Spend
from gateway.db.models import Feedback, Tenant
from gateway.errors import BudgetExceeded, UpstreamError
from gateway.ledger import Ledger, price_for
from gateway.money import usd_to_nanos
from gateway.pipeline import RequestContext
from gateway.providers.base import CallOptions
from gateway.providers.metering import count_prompt_tokens
from gateway.providers.registry import ProviderRegistry
from gateway.runtime import RuntimeParts
from gateway.settings import settings_from_dict
from tests.gateway.budgets_support import Caller, FakeClock, migrated_db, small_settings, sqlite_url
from tests.gateway.gateway_harness import Gateway, asgi_client, make_database
from tests.gateway.routing_support import decision_of, plan_of
from tests.gateway.scripted_models import (
    ScriptedProvider,
    harness,
    plan_json,
    raise_upstream,
    scripted_settings,
)

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

    async def hold(self, worst_case_nanos: int) -> ScriptedHold:
        if len(self.holds) >= self.grant:
            raise BudgetExceeded("tenant budget exhausted for this month period")
        hold = ScriptedHold(self, worst_case_nanos)
        self.holds.append(hold)
        self.open += 1
        return hold


async def _run(provider: ScriptedProvider, budget: ScriptedBudget, body: dict = HIGH):  # type: ignore[no-untyped-def,type-arg]
    h = harness(provider)
    h.pipeline.call_budget = budget
    result = await h.pipeline.run(CTX, body, plan_of(h.settings, body, None))
    return h, result


async def test_every_call_is_held_first_and_settled_to_its_ledger_rows() -> None:
    budget = ScriptedBudget(grant=100)
    h, result = await _run(ScriptedProvider(plans=[PLAN]), budget)
    assert result.stopped_early is None
    assert [e.stage for e in h.entries] == ["plan", "execute", "execute", "review"]
    assert len(budget.holds) == 4 and budget.open == 0
    for hold, entry in zip(budget.holds, h.entries, strict=True):
        assert hold.settled == entry.cost_nanos > 0
        assert hold.worst_nanos >= hold.settled  # the hold covered the call
    assert sum(h.settled or 0 for h in budget.holds) == sum(e.cost_nanos for e in h.entries)


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
    assert sum(h.settled or 0 for h in budget.holds) == sum(e.cost_nanos for e in h.entries)


async def test_failed_and_cancelled_calls_give_their_holds_back() -> None:
    budget = ScriptedBudget(grant=100)
    provider = ScriptedProvider(plans=[PLAN], failures=[raise_upstream()] * 2)  # plan: 2 attempts fail
    with pytest.raises(UpstreamError):
        await _run(provider, budget)
    assert len(budget.holds) == 1 and budget.holds[0].settled == 0 and budget.open == 0

    budget = ScriptedBudget(grant=100)
    provider = ScriptedProvider(plans=[PLAN], step_delay_s=10.0)
    h = harness(provider)
    h.pipeline.call_budget = budget
    task = asyncio.create_task(h.pipeline.run(CTX, HIGH, plan_of(h.settings, HIGH, None)))
    while provider.in_flight == 0:  # the first step is running upstream
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert budget.open == 0 and [hold.settled is not None for hold in budget.holds] == [True, True]
    assert sum(hold.settled or 0 for hold in budget.holds) == sum(e.cost_nanos for e in h.entries)


async def _admin_put(gw, limit: Decimal) -> None:  # type: ignore[no-untyped-def]
    r = await gw.client.put(f"/admin/budgets/tenants/{gw.tenant_id}", headers={"Authorization": f"Bearer {ADMIN}"},
                            json={"period": "total", "limit_usd": str(limit)})
    assert r.status_code == 200, r.text


async def _status(gw) -> dict:  # type: ignore[no-untyped-def,type-arg]
    r = await gw.client.get(f"/admin/budgets/tenants/{gw.tenant_id}", headers={"Authorization": f"Bearer {ADMIN}"})
    return r.json()["status"]  # type: ignore[no-any-return]


@asynccontextmanager
async def budgeted_gateway(tmp_path: Path, provider: ScriptedProvider,
                           redis_prefix: str | None = None) -> AsyncIterator[Gateway]:
    """The real app (SQLite, ledger, key store, default pipeline + budgets); Redis counters when
    ``redis_prefix`` is given (TIERGATE_REDIS_URL set by the caller), else in-process ones."""
    url, sf, tenant_id, raw = make_database(tmp_path)
    cfg = {**scripted_settings().model_dump(exclude={"base_dir"}), "database": {"default_url": url}}
    if redis_prefix is not None:
        cfg["redis"] = {"key_prefix": redis_prefix}
    settings = settings_from_dict(cfg, base_dir=tmp_path)
    ledger = Ledger(sf, tmp_path / "journal", flush_interval_ms=5)
    ledger.start()
    app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf), registry=ProviderRegistry(settings, local_provider=provider)))
    try:
        async with asgi_client(app) as client:
            yield Gateway(app, client, settings, None, ledger, sf, tenant_id, raw)  # type: ignore[arg-type]
    finally:
        ledger.stop()


@pytest.mark.parametrize("counters", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_concurrent_pipelines_never_overspend_a_hard_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  request: pytest.FixtureRequest,
                                                                  counters: str) -> None:
    monkeypatch.setenv("TIERGATE_ADMIN_KEY", ADMIN)
    prefix = None
    if counters == "redis":
        monkeypatch.setenv("TIERGATE_REDIS_URL", request.getfixturevalue("redis_url"))
        prefix = request.getfixturevalue("redis_prefix")
    long_step = " ".join(["word"] * 60)
    revise = "VERDICT: revise\nFAILING: s1\nANSWER:\n" + " ".join(["draft"] * 40)
    provider = ScriptedProvider(plans=[PLAN], reviews=[revise], step=lambda m, t: long_step, step_delay_s=0.005)
    async with budgeted_gateway(tmp_path, provider, prefix) as gw:
        assert (gw.app.state.tiergate.budgets.redis is not None) == (counters == "redis")
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
    async with budgeted_gateway(tmp_path, provider) as gw:
        with gw.session_factory.begin() as s:
            s.execute(sa.update(Tenant).where(Tenant.id == gw.tenant_id).values(allow_prompt_storage=allow))
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=HIGH)
        assert r.status_code == 200, r.text
        (row,) = await gw.feedback_rows()
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
    decision = decision_of(settings, body)
    req = ChatRequest(request_id="r", tenant_id="t", key_id=None, decision=decision, options=CallOptions())
    sent = decision.body  # what the medium call may generate: its answer plus its thinking budget
    assert sent["max_tokens"] > settings.tiers["medium"].max_output_tokens
    worst, tokens = Admission(settings, None).worst_case(req)  # type: ignore[arg-type]
    prompt = count_prompt_tokens(settings.models["mid"], MSGS)
    assert worst >= price_for(settings, "medium", "mid").nanos(prompt, 0, sent["max_tokens"])
    assert tokens >= prompt + sent["max_tokens"]


async def test_streamed_pipeline_settles_every_call_to_the_ledger(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_ADMIN_KEY", ADMIN)
    async with budgeted_gateway(tmp_path, ScriptedProvider(plans=[PLAN])) as gw:
        await _admin_put(gw, Decimal(1))
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={**HIGH, "stream": True})
        assert r.status_code == 200 and b"data: [DONE]" in r.content
        status, rows = await _status(gw), gw.ledger_rows()
        assert len(rows) == 4 and status["held_usd"] == 0
        assert sum((row.cost_usd for row in rows), Decimal(0)) == Decimal(str(status["spent_usd"])) > 0


async def test_admitted_tops_up_admission_and_charges_what_no_hold_covered(tmp_path: Path) -> None:
    sf = migrated_db(sqlite_url(tmp_path))
    with sf.begin() as s:
        put_policy(s, scope="tenant", tenant_id="t1", period="month", limit_usd=1.0)
    rt = build_budget_runtime(small_settings(), sf, clock=FakeClock())
    await rt.start()
    try:
        caller = Caller("t1", "k1")
        usd = usd_to_nanos
        gate = Admitted(rt.budgets, caller, "r1", await rt.budgets.reserve(caller, usd("0.1"), request_id="r1"), {})
        with pytest.raises(RuntimeError):
            await gate.hold(usd("0.1"))  # a direct request is settled as a whole
        await gate.meter_per_call()
        first = await gate.hold(usd("0.25"))  # the admission's 0.1 plus a 0.15 top-up
        assert first is gate.admission and (await rt.budgets.status(caller)).held_nanos == usd("0.25")
        await gate.hold(usd("0.5"))
        with pytest.raises(BudgetExceeded):
            await gate.hold(usd("0.3"))  # 0.75 held: 0.3 more does not fit a $1 limit
        await first.settle(usd("0.01"))  # the top-up is released with it
        status = await rt.budgets.status(caller)
        assert (status.spent_nanos, status.held_nanos) == (usd("0.01"), usd("0.5"))
        await gate.close(Spend(cost_nanos=usd("0.03")))  # the open hold is released; 0.02 no hold covered is charged
        status = await rt.budgets.status(caller)
        assert (status.spent_nanos, status.held_nanos) == (usd("0.03"), 0)
    finally:
        await rt.stop()
