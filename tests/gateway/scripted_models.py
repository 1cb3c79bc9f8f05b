"""Scripted upstream models for pipeline tests (tests only): a ``ChatProvider`` that answers
plan / step / review / direct prompts from scripts, with deterministic token counts, per-path
logprobs for streams, injected failures and a log of every call. Used behind the real
``ProviderRegistry`` and router, so retries, fallbacks and metering are the production ones.

Token counts: prompt = characters of all messages // 4 + 1; completion = words in the reply.
Streams send one word per chunk with its logprob, and (like vLLM's continuous usage stats)
cumulative usage on every chunk, so a stream cut short is billed for what it streamed.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import UpstreamError
from gateway.ledger import LedgerEntry
from gateway.pipeline import Pipeline, ReviewVerdict
from gateway.providers.base import CallOptions
from gateway.providers.registry import ProviderRegistry
from gateway.providers.router import call_tier, stream_tier
from gateway.settings import ModelSettings, Settings, settings_from_dict

PLANNER, STEPPER, REVIEWER = "You are the planner", "You carry out one step", "You are the reviewer"


def scripted_settings(**pipeline: Any) -> Settings:
    """Three local models: small (none/minimal/low), mid (medium), big (high/xhigh)."""
    price = {"small": {"input": 0.05, "output": 0.20}, "mid": {"input": 0.5, "output": 2.0},
             "big": {"input": 2.5, "cached_input": 1.25, "output": 10.0}}
    models = {name: {"provider": "local", "model": f"scripted/{name}", "price": p, "max_retries": 1}
              for name, p in price.items()}
    tiers = {t: {"model": "small", "engine": {"experts_per_token": 1}, "max_output_tokens": 64}
             for t in ("none", "minimal", "low")}
    tiers["medium"] = {"model": "mid", "engine": {"experts_per_token": 2, "thinking_budget_tokens": 64},
                       "max_output_tokens": 128}
    for t, budget in (("high", 128), ("xhigh", 256)):
        tiers[t] = {"model": "big", "engine": {"experts_per_token": 4, "thinking_budget_tokens": budget},
                    "max_output_tokens": 200}
    return settings_from_dict({"models": models, "tiers": tiers,
                               "pipeline": {"max_review_rounds": 2, "xhigh_paths": 3,
                                            "prune_after_tokens": 8, "max_steps": 4, **pipeline}})


def plan_json(*steps: tuple[str, str, list[str]]) -> str:
    return json.dumps({"steps": [{"id": i, "instruction": ins, "expected_output": f"result of {i}",
                                  "depends_on": deps} for i, ins, deps in steps]})


def role_of(messages: list[dict[str, Any]]) -> str:
    system = str(messages[0].get("content") or "") if messages else ""
    for role, marker in (("plan", PLANNER), ("step", STEPPER), ("review", REVIEWER)):
        if system.startswith(marker):
            return role
    return "direct"


def prompt_tokens(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "")) for m in messages) // 4 + 1


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class Call:
    model: str  # the configured model name's upstream id, e.g. scripted/big
    role: str
    body: dict[str, Any]
    options: CallOptions

    @property
    def user_text(self) -> str:
        return str(self.body["messages"][-1].get("content") or "")


@dataclass
class ScriptedProvider:
    """``plans``/``reviews``: replies used in order (the last one repeats). ``step``: maps
    (model, step-prompt text) to the step's reply. ``paths``: seed → per-word logprobs."""

    plans: list[str] = field(default_factory=lambda: [plan_json(("s1", "do it", []))])
    reviews: list[str] = field(default_factory=lambda: ["VERDICT: accept\nANSWER:\nfinal answer"])
    step: Callable[[str, str], str] = lambda model, text: f"output from {model}"
    direct: str = "a direct answer"
    paths: dict[int, tuple[str, list[float]]] = field(default_factory=dict)
    failures: list[Exception] = field(default_factory=list)  # raised by the next calls, in order
    step_delay_s: float = 0.0
    calls: list[Call] = field(default_factory=list)
    closed_early: list[int] = field(default_factory=list)  # seeds of streams cut before the end
    in_flight: int = 0
    max_in_flight_steps: int = 0

    def _reply(self, role: str, model: str, messages: list[dict[str, Any]]) -> str:
        if role == "plan":
            return self.plans.pop(0) if len(self.plans) > 1 else self.plans[0]
        if role == "review":
            return self.reviews.pop(0) if len(self.reviews) > 1 else self.reviews[0]
        if role == "step":
            return self.step(model, str(messages[-1]["content"]))
        return self.direct

    async def complete(self, model: ModelSettings, body: dict[str, Any],
                       options: CallOptions = CallOptions()) -> dict[str, Any]:
        messages = body["messages"]
        role = role_of(messages)
        self.calls.append(Call(model.model, role, body, options))
        if self.failures:
            raise self.failures.pop(0)
        if role == "step":
            self.in_flight += 1
            self.max_in_flight_steps = max(self.max_in_flight_steps, self.in_flight)
            await asyncio.sleep(self.step_delay_s)
            self.in_flight -= 1
        text = self._reply(role, model.model, messages)
        return {"id": "x", "object": "chat.completion", "created": 0, "model": model.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop"}],
                "usage": usage(prompt_tokens(messages), len(text.split()))}

    async def stream(self, model: ModelSettings, body: dict[str, Any],
                     options: CallOptions = CallOptions()) -> AsyncIterator[dict[str, Any]]:
        messages = body["messages"]
        self.calls.append(Call(model.model, role_of(messages), body, options))
        seed = int(body.get("seed") or 0)
        text, logprobs = self.paths[seed]
        words = text.split()
        prompt = prompt_tokens(messages)
        finished = False
        try:
            for n, (word, lp) in enumerate(zip(words, logprobs, strict=True), start=1):
                await asyncio.sleep(0)
                yield {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": model.model,
                       "choices": [{"index": 0, "delta": {"content": word + " "}, "finish_reason": None,
                                    "logprobs": {"content": [{"token": word, "logprob": lp}]}}],
                       "usage": usage(prompt, n)}
            finished = True
        finally:
            if not finished:
                self.closed_early.append(seed)

    async def aclose(self) -> None:
        return None

    def roles(self) -> list[str]:
        return [c.role for c in self.calls]


def raise_upstream(message: str = "scripted 503") -> UpstreamError:
    return UpstreamError(message, upstream_status=503, retryable=True)


async def _no_sleep(_: float) -> None:
    return None


@dataclass
class Harness:
    pipeline: Pipeline
    provider: ScriptedProvider
    settings: Settings
    entries: list[LedgerEntry]
    verdicts: list[ReviewVerdict]


def harness(provider: ScriptedProvider, settings: Settings | None = None) -> Harness:
    """A real ``Pipeline`` over the real registry + router, with the scripted provider behind it."""
    settings = settings or scripted_settings()
    registry = ProviderRegistry(settings, local_provider=provider)
    entries: list[LedgerEntry] = []
    verdicts: list[ReviewVerdict] = []
    pipeline = Pipeline(settings, functools.partial(call_tier, registry, settings, sleep=_no_sleep),
                        entries.append, verdicts.append, lambda: 1_767_225_600.0,
                        functools.partial(stream_tier, registry, settings, sleep=_no_sleep))
    return Harness(pipeline, provider, settings, entries, verdicts)
