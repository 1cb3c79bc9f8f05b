"""``tiergate bench pipeline``: replays a mixed workload through the real routing policy and the
real ``Pipeline`` against simulated upstreams, priced like a frontier high tier and a cheap local
low tier, and compares the total with answering every request on the high tier (and on the low).

Simulated, and printed with the report: token counts per call (below). Real: prompts (from the
shared data), the effort decision (the gateway's classifier, ``gateway.learning.perceive``, when its
artifact exists, else the sources' own difficulty signals, labelled as such), routing, the plan/execute/review/prune
code path, and the accounting. Quality is not measured here.

Imports the pipeline, routing, ledger pricing and settings; no web framework.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.workload import WorkItem, sample_workload
from gateway.ledger.pricing import cost_nanos_for
from gateway.money import format_usd
from gateway.pipeline import Pipeline, RequestContext
from gateway.providers.base import CallOptions, Usage
from gateway.providers.router import Attempt, OnAttempt
from gateway.routing import decide as route
from gateway.settings import TIER_NAMES, Settings, settings_from_dict

# Completion tokens by the prompt's difficulty: the answer itself, and the reasoning a frontier
# model spends before answering when asked directly.
ANSWER_TOKENS = {"easy": 120, "medium": 250, "hard": 450}
HIGH_REASONING_TOKENS = {"easy": 80, "medium": 600, "hard": 1800}
PLAN_TOKENS, STEP_TOKENS, REVIEW_TOKENS = 300, 200, 400
STEPS = {"easy": 2, "medium": 3, "hard": 4}
REVISE_SHARE = {"easy": 0.0, "medium": 0.10, "hard": 0.25}  # first reviews that ask for one revision
PRICES = {"low": (0.05, 0.01, 0.20), "medium": (0.50, 0.10, 2.00), "high": (2.50, 1.25, 10.00)}
ASSUMPTIONS = (
    f"completion tokens: direct answer {ANSWER_TOKENS}; a high-tier direct answer adds reasoning "
    f"{HIGH_REASONING_TOKENS}; medium adds reasoning up to its thinking budget; pipeline plan "
    f"~{PLAN_TOKENS}, each step ~{STEP_TOKENS} ({STEPS} steps), review ~{REVIEW_TOKENS}; "
    f"share of first reviews asking for a revision {REVISE_SHARE}; xhigh runs 3 paths per step, one "
    "with falling confidence (pruned); prompt tokens = characters/4 + 4 per message of the real prompts.")


def bench_settings() -> Settings:
    def price(tier: str) -> dict[str, float]:
        i, c, o = PRICES[tier]
        return {"input": i, "cached_input": c, "output": o}
    models = {"local-moe": {"provider": "local", "model": "engine/models/demo-moe", "price": price("low")},
              "mid": {"provider": "litellm", "model": "simulated/mid", "price": price("medium")},
              "frontier": {"provider": "litellm", "model": "simulated/frontier", "price": price("high")}}
    tiers: dict[str, Any] = {t: {"model": "local-moe", "engine": {"experts_per_token": 1}, "max_output_tokens": 1024}
                             for t in ("none", "minimal", "low")}
    tiers["medium"] = {"model": "mid", "engine": {"thinking_budget_tokens": 1024}, "max_output_tokens": 2048}
    tiers["high"] = {"model": "frontier", "engine": {"thinking_budget_tokens": 2048}, "max_output_tokens": 2048}
    tiers["xhigh"] = {"model": "frontier", "engine": {"thinking_budget_tokens": 4096}, "max_output_tokens": 2048}
    return settings_from_dict({"models": models, "tiers": tiers,
                               "pipeline": {"max_review_rounds": 2, "xhigh_paths": 3, "prune_after_tokens": 32,
                                            "max_steps": 6}})


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "")) // 4 + 4 for m in messages)


def _role(messages: list[dict[str, Any]]) -> str:
    system = str(messages[0].get("content") or "") if messages[0].get("role") == "system" else ""
    for role, marker in (("plan", "You are the planner"), ("step", "You carry out one step"),
                         ("review", "You are the reviewer")):
        if system.startswith(marker):
            return role
    return "direct"


@dataclass
class SimulatedUpstream:
    """Stands in for every tier for one request of a known difficulty."""

    settings: Settings
    difficulty: str
    rng: random.Random
    reviews: int = 0

    def _plan(self) -> str:
        n = STEPS[self.difficulty]
        steps = [{"id": f"s{i}", "instruction": f"part {i}", "expected_output": "a result",
                  "depends_on": [] if i < n else [f"s{j}" for j in range(1, n)]} for i in range(1, n + 1)]
        return json.dumps({"steps": steps})

    def _review(self) -> str:
        self.reviews += 1
        if self.reviews == 1 and self.rng.random() < REVISE_SHARE[self.difficulty]:
            return "VERDICT: revise\nFAILING: s1\nANSWER:\ndraft"
        return "VERDICT: accept\nANSWER:\nfinal"

    def reply(self, tier: str, messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, int]:
        role = _role(messages)
        if role == "plan":
            return self._plan(), PLAN_TOKENS
        if role == "step":
            return "step result", STEP_TOKENS
        if role == "review":
            return self._review(), REVIEW_TOKENS
        return "answer", direct_completion(self.settings, tier, self.difficulty)

    async def complete(self, tier: str, body: dict[str, Any], options: CallOptions, *,
                       on_attempt: OnAttempt) -> tuple[dict[str, Any], str]:
        text, tokens = self.reply(tier, body["messages"], body["max_tokens"])
        usage = Usage(prompt_tokens(body["messages"]), min(tokens, body["max_tokens"]))
        model = self.settings.tiers[tier].model  # type: ignore[index]
        on_attempt(Attempt(model, usage, "ok", 0))
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                "usage": usage.to_openai()}, model

    async def stream(self, tier: str, body: dict[str, Any], options: CallOptions, *,
                     on_attempt: OnAttempt) -> tuple[AsyncIterator[dict[str, Any]], str]:
        model = self.settings.tiers[tier].model  # type: ignore[index]
        falling = int(body.get("seed") or 0) == 2
        return _PathStream(model, prompt_tokens(body["messages"]), min(STEP_TOKENS, body["max_tokens"]),
                           falling, on_attempt), model


@dataclass
class _PathStream:
    model: str
    prompt: int
    tokens: int
    falling: bool
    on_attempt: OnAttempt
    sent: int = 0
    reported: bool = field(default=False)

    def __aiter__(self) -> _PathStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.sent >= self.tokens:
            await self.aclose(status="ok")
            raise StopAsyncIteration
        self.sent += 1
        lp = -0.2 - (0.02 * self.sent if self.falling else 0.0)
        return {"choices": [{"index": 0, "delta": {"content": "x "},
                             "logprobs": {"content": [{"token": "x", "logprob": lp}]}}]}

    async def aclose(self, status: str = "cancelled") -> None:
        if not self.reported:
            self.reported = True
            self.on_attempt(Attempt(self.model, Usage(self.prompt, self.sent), status, 0))  # type: ignore[arg-type]


def direct_completion(settings: Settings, tier: str, difficulty: str) -> int:
    answer, reasoning = ANSWER_TOKENS[difficulty], HIGH_REASONING_TOKENS[difficulty]
    if tier in ("high", "xhigh"):
        return answer + reasoning
    budget = settings.tiers[tier].engine.thinking_budget_tokens or 0  # type: ignore[index]
    return answer + min(reasoning, budget)


Decide = Callable[[list[dict[str, Any]]], str]


def load_decider(settings: Settings | None) -> tuple[Decide | None, str]:
    """The gateway's own decider (``gateway.learning.perceive``: the classifier artifact with the config's
    target mix) when an artifact exists; else None, and why (the signal fallback is used)."""
    if settings is None:
        return None, "classifier disabled with --no-classifier"
    from gateway.learning.perceive import artifact_candidates, build_perceiver

    perceiver = build_perceiver(settings)
    if perceiver is None:
        return None, "no classifier artifact at " + ", ".join(str(p) for p in artifact_candidates(settings))
    mix = ", ".join(f"{k} {v:.2f}" for k, v in settings.classifier.target_mix.items())
    return (lambda messages: str(perceiver.decide(messages).tier)), (
        f"the gateway's classifier ({perceiver.version}; configured target mix {mix})")


@dataclass
class BenchTotals:
    """Costs in nano-USD."""

    routed: int = 0
    all_high: int = 0
    all_low: int = 0
    ledger_baseline: int = 0
    pipeline_cost: int = 0
    pipeline_all_high: int = 0
    pruned_paths: int = 0
    revisions: int = 0
    effort: Counter[str] = field(default_factory=Counter)
    cost_by_effort: Counter[str] = field(default_factory=Counter)
    modes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (source difficulty, mode)
    efforts: list[str] = field(default_factory=list)  # each request's effort, in order


async def replay(items: list[WorkItem], decide: Decide | None, seed: int) -> BenchTotals:
    settings = bench_settings()
    totals = BenchTotals()
    rng = random.Random(seed)
    for n, item in enumerate(items):
        messages = [{"role": "user", "content": item.prompt}]
        tier = decide(messages) if decide else item.signal_tier
        ex = route(settings, "auto", {"messages": messages}, reasoning_effort=tier).plan
        assert ex is not None
        upstream = SimulatedUpstream(settings, item.difficulty, rng)
        prompt = prompt_tokens(messages)
        high_usage = Usage(prompt, ANSWER_TOKENS[item.difficulty] + HIGH_REASONING_TOKENS[item.difficulty])
        all_high = cost_nanos_for(settings, "high", "frontier", high_usage)[0]
        if ex.uses_pipeline:
            pipe = Pipeline(settings, upstream.complete, lambda e: None, None, lambda: 0.0, upstream.stream)
            result = await pipe.run(RequestContext(f"req_{n}", "bench", None), {"messages": messages}, ex)
            cost, baseline = result.cost_nanos, result.baseline_cost_nanos
            totals.pipeline_cost += cost
            totals.pipeline_all_high += all_high
            totals.pruned_paths += sum(1 for c in result.calls if c.status == "cancelled")
            totals.revisions += result.review_rounds
        else:
            usage = Usage(prompt, direct_completion(settings, ex.tier, item.difficulty))
            cost, baseline = cost_nanos_for(settings, ex.tier, settings.tiers[ex.tier].model, usage)
        totals.routed += cost
        totals.ledger_baseline += baseline
        totals.all_high += all_high
        totals.all_low += cost_nanos_for(settings, "low", "local-moe",
                                         Usage(prompt, ANSWER_TOKENS[item.difficulty]))[0]
        totals.effort[ex.effort] += 1
        totals.efforts.append(ex.effort)
        totals.modes[(item.difficulty, ex.mode)] += 1
        totals.cost_by_effort[ex.effort] += cost
    return totals


def report(totals: BenchTotals, *, n: int, mix: tuple[float, float, float], seed: int, decided_by: str,
           data_dir: Path) -> str:
    def share(t: str) -> str:
        return f"{t} {totals.effort[t] / n:.1%} (${format_usd(totals.cost_by_effort[t], 4)})"
    lines = [
        f"tiergate bench pipeline: {n} requests from {data_dir}, source difficulty mix easy/medium/hard "
        f"{mix[0]:.2f}/{mix[1]:.2f}/{mix[2]:.2f}, seed {seed}",
        f"effort decided by: {decided_by}",
        "prices per 1M tokens (input/cached/output): " + "; ".join(
            f"{t} ${p[0]:.2f}/${p[1]:.2f}/${p[2]:.2f}" for t, p in PRICES.items()) + " (xhigh = high)",
        "simulated upstreams: " + ASSUMPTIONS,
        "effort mix: " + ", ".join(share(t) for t in TIER_NAMES),
        f"routed total:               ${format_usd(totals.routed, 4)}",
        f"all requests on high tier:  ${format_usd(totals.all_high, 4)}   routed / all-high = "
        f"{totals.routed / totals.all_high:.3f}  (target <= 0.40)",
        f"all requests on low tier:   ${format_usd(totals.all_low, 4)}   routed / all-low  = "
        f"{totals.routed / totals.all_low:.2f}",
        f"pipeline requests only:     ${format_usd(totals.pipeline_cost, 4)} vs "
        f"${format_usd(totals.pipeline_all_high, 4)} answered "
        f"directly on high = {totals.pipeline_cost / totals.pipeline_all_high:.3f}" if totals.pipeline_all_high else
        "pipeline requests only:     none",
        f"ledger baseline (same tokens at high price): ${format_usd(totals.ledger_baseline, 4)}; pruned paths: "
        f"{totals.pruned_paths}; revise rounds: {totals.revisions}",
        "routing by source difficulty: " + "; ".join(
            f"{d}: " + ", ".join(f"{m} {totals.modes[(d, m)]}" for m in ("direct", "thinking", "pipeline"))
            for d in ("easy", "medium", "hard")),
        "quality is not measured by this benchmark (a hard prompt routed to a cheap tier saves money "
        "and may lose quality).",
    ]
    return "\n".join(lines)


def run_bench(data_dir: Path, n: int, mix: tuple[float, float, float], seed: int,
              classifier_settings: Settings | None) -> str:
    """``classifier_settings``: the config whose classifier decides effort (None: signal fallback)."""
    items = sample_workload(data_dir, n, mix, seed)
    decide, decided_by = load_decider(classifier_settings)
    if decide is None:
        decided_by = f"FALLBACK: each source's difficulty signal mapped to a tier ({decided_by})"
    totals = asyncio.run(replay(items, decide, seed))
    return report(totals, n=n, mix=mix, seed=seed, decided_by=decided_by, data_dir=data_dir)
