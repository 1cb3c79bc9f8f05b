"""``Pipeline``: perceive → plan (high) → execute (low) → review (high) for one request.

The effort decision (perceive) arrives as a ``routing.ExecutionPlan``. The plan stage asks the
review tier for a JSON plan, repairs it once, and falls back to a direct answer from that tier.
Steps run on the execute tier as a DAG (xhigh: several pruned paths per step). The review
tier checks the results and composes the answer; "revise" re-runs the failing steps (and
their dependants) one tier up, at most ``settings.pipeline.max_review_rounds`` times. A
request's ``max_cost_usd`` is checked before every call, and with budgets in front (``CallBudget``)
every call's worst case is held on the tenant's budgets first; when the next call could pass the
cap, or the budget cannot hold it, the pipeline stops with the best answer so far and says so
(a budget refusal before anything was produced is the 429 ``budget_exceeded`` itself). Review verdicts go to the injected
feedback sink; every call goes to the ledger sink as it finishes.

Models are reached only through the injected ``CallModel``/``StreamModel`` callables: this
module knows nothing of FastAPI, Starlette, Celery, the database or concrete providers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import InvalidRequest
from gateway.log_safety import describe
from gateway.money import format_usd, usd_number
from gateway.pipeline.accounting import Accountant, BudgetRefused, CostCapReached, StopEarly
from gateway.pipeline.calls import StageCaller
from gateway.pipeline.execute import execute_plan, request_text
from gateway.pipeline.plan import (
    Plan,
    PlanInvalid,
    PlanStep,
    parse_plan,
    plan_messages,
    repair_messages,
    single_step_plan,
)
from gateway.pipeline.prune import PathPruner, run_paths, vote
from gateway.pipeline.result import PipelineResult
from gateway.pipeline.review import Review, parse_review, review_messages
from gateway.pipeline.stream import PipelineStream
from gateway.pipeline.types import (
    CallBudget,
    CallModel,
    Clock,
    FeedbackSink,
    LedgerSink,
    ProgressSink,
    RequestContext,
    ReviewVerdict,
    StageCall,
    StreamModel,
)
from gateway.routing import ExecutionPlan, tier_above, tier_rank
from gateway.settings import Settings

log = logging.getLogger(__name__)
REVIEW_OVERHEAD_TOKENS = 48  # the VERDICT/FAILING/ANSWER lines around the answer
PATH_TEMPERATURE = 0.8
SAMPLING_FIELDS = ("temperature", "top_p", "seed")  # passed from the client to every stage call


def _ignore(_: str) -> None:
    return None


@dataclass
class _RunState:
    """What a request has produced so far (read when it has to stop early)."""

    plan: Plan | None = None
    outputs: dict[str, str] = field(default_factory=dict)
    step_tiers: dict[str, str] = field(default_factory=dict)
    review: Review | None = None
    review_call: StageCall | None = None
    rounds: int = 0
    first_failing: tuple[str, ...] = ()
    alternatives: dict[str, list[str]] = field(default_factory=dict)


class Pipeline:
    def __init__(self, settings: Settings, call_model: CallModel, ledger_sink: LedgerSink,
                 feedback_sink: FeedbackSink | None = None, clock: Clock = time.time,
                 stream_model: StreamModel | None = None, call_budget: CallBudget | None = None) -> None:
        self.settings, self.call_model, self.ledger_sink = settings, call_model, ledger_sink
        self.feedback_sink, self.clock, self.stream_model = feedback_sink, clock, stream_model
        self.call_budget = call_budget  # per-call budget holds of this request (None: no budgets)

    async def run(self, ctx: RequestContext, body: dict[str, Any], execution: ExecutionPlan) -> PipelineResult:
        return await self._run(ctx, body, execution, _ignore)

    def stream(self, ctx: RequestContext, body: dict[str, Any], execution: ExecutionPlan) -> PipelineStream:
        """Chunks: stage progress as ``reasoning_content``, then the answer as ``content``, then
        usage (every stage). ``.result`` holds the ``PipelineResult`` once the stream is drained.
        The first chunk comes only once the first stage call holds its budget, so a budget that
        cannot hold it is refused before the response starts."""
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return PipelineStream(lambda progress, admitted: self._run(ctx, body, execution, progress, admitted),
                              request_id=ctx.request_id, model=str(body.get("model") or ""),
                              created=int(self.clock()), include_usage=include_usage)

    async def _run(self, ctx: RequestContext, body: dict[str, Any], ex: ExecutionPlan,
                   progress: ProgressSink, on_admitted: Callable[[], None] | None = None) -> PipelineResult:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty array", param="messages")
        acct = Accountant(self.settings, ctx, self.ledger_sink, self.clock, ex.max_cost_usd)
        sampling = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
        caller = StageCaller(self.settings, self.call_model, acct, self.stream_model, sampling, self.call_budget,
                             on_admitted)
        state = _RunState()
        result = PipelineResult(answer="", execution=ex, calls=acct.calls)
        progress(f"[perceive] effort {ex.effort} ({ex.effort_source}); plan and review on {ex.review_tier}, "
                 f"execute on {ex.execute_tier}" + (f", {ex.paths} paths per step" if ex.paths > 1 else ""))
        try:
            await self._stages(ctx, messages, ex, caller, state, result, progress)
        except StopEarly as err:
            await self._stop_early(err, messages, ex, caller, state, result, progress)
        return result

    async def _stages(self, ctx: RequestContext, messages: list[dict[str, Any]], ex: ExecutionPlan,
                      caller: StageCaller, state: _RunState, result: PipelineResult,
                      progress: ProgressSink) -> None:
        plan = await self._plan(messages, ex, caller, result, progress)
        if plan is None:
            progress(f"[plan] no valid plan after one repair; answering directly on {ex.review_tier}")
            reply_tokens = ex.max_answer_tokens + (ex.thinking_budget_tokens or 0)
            reply = await caller.call("direct", ex.review_tier, messages, reply_tokens)
            result.answer, result.answer_call, result.plan_source = reply.text, reply.call, "fallback"
            return
        state.plan = plan
        state.step_tiers = {s.id: ex.execute_tier for s in plan.steps}
        request = request_text(messages)
        progress(f"[execute] {len(plan.steps)} step(s) on {ex.execute_tier}")
        await self._execute(plan, request, ex, caller, state, None, progress)
        state.review = await self._review(request, plan, ex, caller, state, progress)
        state.first_failing = state.review.failing_steps
        while state.review.verdict == "revise" and state.rounds < self.settings.pipeline.max_review_rounds:
            state.rounds += 1
            rerun = plan.dependants(set(state.review.failing_steps))
            for sid in rerun:
                state.step_tiers[sid] = tier_above(state.step_tiers[sid])
            progress(f"[revise {state.rounds}] re-running {', '.join(sorted(rerun))} one tier up "
                     f"({', '.join(sorted({state.step_tiers[s] for s in rerun}))})")
            await self._execute(plan, request, ex, caller, state, rerun, progress)
            state.review = await self._review(request, plan, ex, caller, state, progress)
        self._finish_review(state, result)
        self._send_feedback(ctx, messages, ex, state)

    async def _plan(self, messages: list[dict[str, Any]], ex: ExecutionPlan, caller: StageCaller,
                    result: PipelineResult, progress: ProgressSink) -> Plan | None:
        max_steps = self.settings.pipeline.max_steps
        budget = ex.thinking_budget_tokens or self.settings.tiers[ex.review_tier].max_output_tokens
        progress(f"[plan] asking {ex.review_tier} for a plan")
        reply = await caller.call("plan", ex.review_tier, plan_messages(messages, max_steps), budget)
        try:
            plan = parse_plan(reply.text, max_steps)
        except PlanInvalid as err:
            progress(f"[plan] invalid plan ({err}); asking for a repair")
            repaired = await caller.call("plan", ex.review_tier,
                                         repair_messages(messages, reply.text, str(err), max_steps), budget,
                                         round=1)
            try:
                plan = parse_plan(repaired.text, max_steps, allow_lines=True)
            except PlanInvalid:
                if self.settings.pipeline.plan_fallback != "single_step":
                    return None
                progress("[plan] no valid plan after one repair; running the request as a single step")
                plan = single_step_plan()
        result.plan_source, result.plan = plan.source, plan.to_dict()
        progress("[plan] " + "; ".join(f"{s.id}: {s.instruction}" for s in plan.steps))
        return plan

    def _step_tokens(self, ex: ExecutionPlan, tier: str) -> int:
        limit = self.settings.tiers[tier].max_output_tokens  # type: ignore[index]
        return min(limit, ex.thinking_budget_tokens) if ex.thinking_budget_tokens else limit

    async def _execute(self, plan: Plan, request: str, ex: ExecutionPlan, caller: StageCaller,
                       state: _RunState, only: set[str] | None, progress: ProgressSink) -> None:
        async def run_step(step: PlanStep, step_msgs: list[dict[str, Any]]) -> str:
            tier = state.step_tiers[step.id]
            if ex.paths > 1 and self.stream_model is not None:
                text = await self._multipath(step, step_msgs, tier, ex, caller, state, progress)
            else:
                reply = await caller.call("execute", tier, step_msgs, self._step_tokens(ex, tier),
                                          step_id=step.id, round=state.rounds)
                text = reply.text
            progress(f"[execute] {step.id} done on {tier}")
            return text

        outcome = await execute_plan(plan, request, run_step, only=only, previous=state.outputs)
        state.outputs = outcome.outputs
        if outcome.stopped is not None:
            raise outcome.stopped

    async def _multipath(self, step: PlanStep, step_msgs: list[dict[str, Any]], tier: str, ex: ExecutionPlan,
                         caller: StageCaller, state: _RunState, progress: ProgressSink) -> str:
        max_tokens = self._step_tokens(ex, tier)
        tickets = [await caller.ticket("execute", tier, step_msgs, max_tokens)]  # at least one path, or stop
        try:
            for _ in range(ex.paths - 1):
                try:
                    tickets.append(await caller.ticket("execute", tier, step_msgs, max_tokens))
                except StopEarly:
                    break
            paths = len(tickets)
            pruner = PathPruner(paths, self.settings.pipeline.prune_after_tokens)
            outcomes = await run_paths(paths, lambda i: caller.stream(
                "execute", tier, step_msgs, max_tokens, step_id=step.id, path=i, round=state.rounds,
                ticket=tickets[i], logprobs=True, temperature=PATH_TEMPERATURE, seed=i), pruner)
        finally:
            for ticket in tickets:
                if not ticket.opened:  # an opened stream settles its own ticket when it is closed
                    await ticket.close(())
        chosen = vote(outcomes)
        state.alternatives[step.id] = [o.text for o in outcomes if not o.pruned and o is not chosen]
        pruned = [o.index for o in outcomes if o.pruned]
        progress(f"[execute] {step.id}: {paths} paths, pruned {pruned or 'none'}, chose path {chosen.index}")
        return chosen.text

    async def _review(self, request: str, plan: Plan, ex: ExecutionPlan, caller: StageCaller,
                      state: _RunState, progress: ProgressSink) -> Review:
        progress(f"[review] {ex.review_tier} checking {len(state.outputs)} result(s)")
        msgs = review_messages(request, plan, state.outputs, ex.verbosity, state.alternatives)
        reply = await caller.call("review", ex.review_tier, msgs, ex.max_answer_tokens + REVIEW_OVERHEAD_TOKENS,
                                  round=state.rounds)
        state.review_call = reply.call
        review = parse_review(reply.text, plan)
        failing = f" (failing: {', '.join(review.failing_steps)})" if review.failing_steps else ""
        progress(f"[review] verdict {review.verdict}{failing}")
        return review

    @staticmethod
    def _finish_review(state: _RunState, result: PipelineResult) -> None:
        assert state.review is not None
        result.answer = state.review.answer or _best_outputs(state)
        result.answer_call, result.verdict, result.review_rounds = state.review_call, state.review.verdict, state.rounds
        if state.review.verdict == "revise":
            result.notes.append(f"review still asked for revisions after {state.rounds} round(s)")

    def _send_feedback(self, ctx: RequestContext, messages: list[dict[str, Any]], ex: ExecutionPlan,
                       state: _RunState) -> None:
        if self.feedback_sink is None or state.review is None or not state.review.parsed:
            return  # a reply without a recognisable verdict is no training signal
        accepted = state.review.verdict == "accept"
        label = max(state.step_tiers.values(), key=tier_rank) if accepted else ex.effort
        verdict = ReviewVerdict(
            request_id=ctx.request_id, tenant_id=ctx.tenant_id, verdict=state.review.verdict,
            failing_steps=state.first_failing, rounds=state.rounds, effort=ex.effort, label_tier=label,
            messages=tuple(messages), allow_prompt_storage=ctx.allow_prompt_storage)
        try:
            self.feedback_sink(verdict)
        except Exception as err:  # training feedback is not on the money path; the answer stands
            log.error("could not record review verdict for %s: %s", ctx.request_id, describe(err))

    async def _stop_early(self, err: StopEarly, messages: list[dict[str, Any]], ex: ExecutionPlan,
                          caller: StageCaller, state: _RunState, result: PipelineResult,
                          progress: ProgressSink) -> None:
        """Answer with the best so far and say why. With nothing produced: a cost cap tries one
        cheap direct answer; a budget refusal is the request's 429 ``budget_exceeded``."""
        progress(f"[stop] {_why(err)}")
        result.stopped_early = {"reason": err.reason, "stage": err.stage,
                                "spent_usd": usd_number(caller.accountant.cost_nanos)}
        if isinstance(err, CostCapReached):
            result.stopped_early["max_cost_usd"] = ex.max_cost_usd
        if state.review is not None:
            result.answer, result.answer_call = state.review.answer or _best_outputs(state), state.review_call
            result.verdict, result.review_rounds = state.review.verdict, state.rounds
        elif state.outputs:
            result.answer = _best_outputs(state)
        elif isinstance(err, BudgetRefused):
            raise err.error
        else:
            try:
                reply = await caller.call("direct", ex.execute_tier, messages, ex.max_answer_tokens)
                result.answer, result.answer_call = reply.text, reply.call
                result.plan_source = result.plan_source if state.plan else "none"
            except BudgetRefused as refused:
                raise refused.error from None
            except StopEarly:
                result.answer = ""
        note = f"[tiergate] Stopped early: {_why(err)}; this is the best answer so far."
        result.notes.append(note)
        result.answer = f"{result.answer}\n\n{note}" if result.answer else note


def _why(err: StopEarly) -> str:
    if isinstance(err, CostCapReached):
        return f"the next {err.stage} call could exceed the cost cap of ${format_usd(err.cap_nanos, 6)}"
    return f"the budget cannot cover the next {err.stage} call"


def _best_outputs(state: _RunState) -> str:
    if state.plan is None:
        return ""
    sinks = [s.id for s in state.plan.sinks() if s.id in state.outputs]
    ids = sinks or [s.id for s in state.plan.steps if s.id in state.outputs]
    return "\n\n".join(state.outputs[i] for i in ids)
