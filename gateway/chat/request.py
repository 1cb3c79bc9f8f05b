"""A chat request ready to execute, and the executor contract.

``ChatRequest`` is immutable: who asks, the request id, the ``RouteDecision`` made once (before
admission) and the per-call options. Executors get what they may act on as explicit arguments —
a ``CallContext``: where each upstream call's ledger row goes (``CallSink``) and, for executors
that make several calls, the per-call budget holds — and return explicit results: a
``Completion`` (the answer and its ``Spend``) or a ``SpendStream``.

Imports routing, the provider contract, the pipeline's budget protocol and chat.spend only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from gateway.chat.spend import CallSink, Completion, SpendStream
from gateway.pipeline.types import CallBudget
from gateway.providers.base import CallOptions
from gateway.routing import RouteDecision


@dataclass(frozen=True)
class ChatRequest:
    request_id: str
    tenant_id: str
    key_id: str | None
    decision: RouteDecision
    options: CallOptions
    include_usage: bool = False
    allow_prompt_storage: bool = False  # the tenant lets review feedback keep the prompt's text
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class CallContext:
    """What an executor is handed besides the request: the sink for its calls' ledger rows and,
    when budgets are in front, the per-call holds (a pipeline holds each call before making it)."""

    sink: CallSink
    budget: CallBudget | None = None


class Executor(Protocol):
    async def complete(self, req: ChatRequest, calls: CallContext) -> Completion:
        """The answer and what it cost; every upstream call's row already handed to ``calls.sink``."""
        ...

    async def stream(self, req: ChatRequest, calls: CallContext) -> SpendStream:
        """An opened chunk stream (errors before the upstream's first chunk raise here)."""
        ...
