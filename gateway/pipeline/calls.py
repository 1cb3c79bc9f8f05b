"""Calling a model for one pipeline stage: builds the upstream body, applies the tier's engine
knobs (experts per token), checks the cost cap first, and accounts every upstream attempt the
router reports (retries, fallbacks and cancelled streams included) as a ledger row.

Imports pipeline types/accounting, the provider contract and router types only (the model is
reached through the injected ``CallModel`` / ``StreamModel`` callables).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway.errors import UpstreamError
from gateway.pipeline.accounting import Accountant
from gateway.pipeline.types import CallModel, Stage, StageCall, StreamModel
from gateway.providers.base import CallOptions, Usage
from gateway.providers.router import Attempt, OnAttempt
from gateway.settings import Settings


@dataclass(frozen=True)
class Reply:
    text: str
    call: StageCall  # the accounted attempt that produced this reply

    @property
    def model(self) -> str:
        return self.call.model

    @property
    def usage(self) -> Usage:
        return self.call.usage


def message_text(response: dict[str, Any]) -> str:
    choices = response.get("choices") or []
    if not choices:
        raise UpstreamError("upstream returned no choices", retryable=False)
    return str((choices[0].get("message") or {}).get("content") or "")


class StageCaller:
    """The only way pipeline stages reach a model."""

    def __init__(self, settings: Settings, call_model: CallModel, accountant: Accountant,
                 stream_model: StreamModel | None = None, sampling: dict[str, Any] | None = None) -> None:
        self.settings, self.call_model, self.accountant = settings, call_model, accountant
        self.stream_model = stream_model
        self.sampling = dict(sampling or {})  # the client's temperature/top_p/seed, for every stage

    def options(self, tier: str) -> CallOptions:
        knobs = self.settings.tiers[tier].engine  # type: ignore[index]
        return CallOptions(experts_per_token=knobs.experts_per_token)

    def _billing(self, stage: Stage, tier: str, *, step_id: str | None, path: int | None,
                 round: int) -> tuple[OnAttempt, list[StageCall]]:
        calls: list[StageCall] = []

        def on_attempt(attempt: Attempt) -> None:
            calls.append(self.accountant.record(stage, tier, attempt.model_name, attempt.usage,
                                                attempt.status, step_id=step_id, path=path, round=round))
        return on_attempt, calls

    def body(self, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
        return {"messages": messages, "max_tokens": max_tokens, **self.sampling, **extra}

    async def call(self, stage: Stage, tier: str, messages: list[dict[str, Any]], max_tokens: int, *,
                   step_id: str | None = None, path: int | None = None, round: int = 0,
                   **extra: Any) -> Reply:
        held = self.accountant.reserve(stage, tier, messages, max_tokens)
        on_attempt, calls = self._billing(stage, tier, step_id=step_id, path=path, round=round)
        try:
            response, model = await self.call_model(tier, self.body(messages, max_tokens, **extra),
                                                    self.options(tier), on_attempt=on_attempt)
        finally:
            self.accountant.release(held)
        ok = [c for c in calls if c.status == "ok"]
        if not ok:  # a caller that did not report its attempt: bill what the response says
            ok = [self.accountant.record(stage, tier, model, Usage.from_openai(response.get("usage")), "ok",
                                         step_id=step_id, path=path, round=round)]
        return Reply(message_text(response), ok[-1])

    async def stream(self, stage: Stage, tier: str, messages: list[dict[str, Any]], max_tokens: int, *,
                     step_id: str | None = None, path: int | None = None, round: int = 0,
                     **extra: Any) -> AsyncIterator[dict[str, Any]]:
        """An opened chunk stream; the attempt is billed when it ends or is closed (cancelled)."""
        if self.stream_model is None:
            raise RuntimeError("no stream_model was given to the pipeline")
        on_attempt, _ = self._billing(stage, tier, step_id=step_id, path=path, round=round)
        body = self.body(messages, max_tokens, **extra)
        chunks, _model = await self.stream_model(tier, body, self.options(tier), on_attempt=on_attempt)
        return chunks
