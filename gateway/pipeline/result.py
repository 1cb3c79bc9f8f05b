"""The outcome of one pipeline request and its wire forms: the OpenAI ``chat.completion`` dict
with the ``tiergate`` extension object (per-stage tier, model, tokens, cost), total usage, and
the ``x-tiergate-*`` headers. Every figure is derived from the same ``StageCall`` rows that
went to the ledger (integer nano-USD, formatted as USD only here), so rows, headers and
response always agree.

Imports pipeline types, routing and the provider contract only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.money import format_usd, usd_number
from gateway.pipeline.types import StageCall, calls_baseline_cost_nanos, calls_cost_nanos, calls_usage
from gateway.providers.base import Usage
from gateway.routing import ExecutionPlan

BASELINE_NOTE = "the same tokens priced at the high tier"


@dataclass
class PipelineResult:
    answer: str
    execution: ExecutionPlan
    calls: list[StageCall]
    answer_call: StageCall | None = None  # the call whose reply is the final answer
    plan_source: str = "none"  # json | list | lines | single_step | fallback (direct high answer) | none
    plan: dict[str, Any] | None = None
    verdict: str | None = None
    review_rounds: int = 0
    stopped_early: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def cost_nanos(self) -> int:
        return calls_cost_nanos(self.calls)

    @property
    def baseline_cost_nanos(self) -> int:
        return calls_baseline_cost_nanos(self.calls)

    @property
    def saved_nanos(self) -> int:
        return self.baseline_cost_nanos - self.cost_nanos

    @property
    def usage(self) -> Usage:
        """All stages' tokens; completion tokens of every call but the one that wrote the final
        answer count as reasoning tokens."""
        total = calls_usage(self.calls)
        answer_tokens = 0
        if self.answer_call is not None:
            answer_tokens = self.answer_call.usage.completion_tokens - self.answer_call.usage.reasoning_tokens
        return Usage(total.prompt_tokens, total.completion_tokens, total.cached_tokens,
                     max(0, total.completion_tokens - answer_tokens))

    @property
    def model(self) -> str:
        return self.answer_call.model if self.answer_call else (self.calls[-1].model if self.calls else "")

    def tiergate_object(self) -> dict[str, Any]:
        ex = self.execution
        return {
            "effort": ex.effort, "effort_source": ex.effort_source, "mode": ex.mode,
            "capped_from": ex.capped_from, "verbosity": ex.verbosity,
            "max_answer_tokens": ex.max_answer_tokens, "thinking_budget_tokens": ex.thinking_budget_tokens,
            "plan_source": self.plan_source, "plan": self.plan, "verdict": self.verdict,
            "review_rounds": self.review_rounds,
            "paths": ex.paths, "pruned_paths": sum(1 for c in self.calls if c.status == "cancelled"),
            "pruned_cost_usd": usd_number(sum(c.cost_nanos for c in self.calls if c.status == "cancelled")),
            "stages": [c.to_dict() for c in self.calls],
            "cost_usd": usd_number(self.cost_nanos), "baseline_cost_usd": usd_number(self.baseline_cost_nanos),
            "saved_usd": usd_number(self.saved_nanos), "baseline": BASELINE_NOTE,
            "max_cost_usd": ex.max_cost_usd, "stopped_early": self.stopped_early, "notes": list(self.notes),
        }

    def headers(self) -> dict[str, str]:
        return {"x-tiergate-effort": self.execution.effort, "x-tiergate-cost-usd": format_usd(self.cost_nanos),
                "x-tiergate-saved-usd": format_usd(self.saved_nanos)}

    def to_response(self, request_id: str, requested_model: str, created: int) -> dict[str, Any]:
        return {
            "id": request_id, "object": "chat.completion", "created": created, "model": requested_model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": self.answer},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": self.usage.to_openai(), "tiergate": self.tiergate_object(),
        }
