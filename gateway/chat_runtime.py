"""The executor stack a chat request runs through, built once per process (the app's lifespan)
or per batch worker: the four-layer ``PipelineExecutor`` over a ``DirectExecutor``, behind
``BudgetedExecutor`` (budgets and rate limits). Both the live route and batch lines use it, each
with its own ledger sink. Imports the executors, budgets and perceive; no FastAPI, no Celery.
"""

from __future__ import annotations

from typing import Any

from gateway.budget_execution import BudgetedExecutor
from gateway.execution import DirectExecutor, Executor, LedgerSink
from gateway.providers.registry import ProviderRegistry
from gateway.settings import Settings


def build_pipeline_executor(settings: Settings, registry: ProviderRegistry, ledger: LedgerSink,
                            budget_runtime: Any, session_factory: Any) -> Executor:
    """The pipeline over the direct executor; every upstream call's row goes to ``ledger``."""
    from gateway.perceive import FeedbackRecorder
    from gateway.pipeline.executor import PipelineExecutor

    async def soft_budget(req: Any) -> bool:
        return bool((await budget_runtime.budgets.status(req)).soft_exceeded)

    return PipelineExecutor(settings, registry, ledger, DirectExecutor(settings, registry, ledger),
                            soft_budget_exceeded=soft_budget,
                            feedback_sink=FeedbackRecorder(session_factory, settings))


def budgeted(settings: Settings, inner: Executor, budget_runtime: Any, *, rate_limited: bool = True) -> Executor:
    """``inner`` behind the budgets (and, unless ``rate_limited`` is False, the rate limits)."""
    return BudgetedExecutor(settings, inner, budget_runtime.budgets,
                            budget_runtime.rate_limiter if rate_limited else None)
