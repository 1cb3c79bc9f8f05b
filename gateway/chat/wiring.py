"""Building a ``ChatFlow``: the direct and pipelined executors over one provider registry, the
admission over the process's budgets, the request records and call rows into one ledger. The
live route's flow (rate limits, parked rows) and each batch runner's (``jobs.concurrency``
throttles instead; every row journaled as its call ends) are built here.

Imports the chat parts, budgets and perceive; no FastAPI, no Celery.
"""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from gateway.budgets import BudgetRuntime
from gateway.chat.admission import Admission
from gateway.chat.direct import DirectExecutor
from gateway.chat.flow import ChatFlow, DecisionSink, RequestLedger
from gateway.chat.pipelined import PipelinedExecutor
from gateway.chat.request import Executor
from gateway.providers.registry import ProviderRegistry
from gateway.routing import DecideAuto
from gateway.settings import Settings


def build_flow(settings: Settings, registry: ProviderRegistry, ledger: RequestLedger, budgets: BudgetRuntime,
               session_factory: sessionmaker[Session], *, decide_auto: DecideAuto | None,
               pipelined: Executor | None = None, batch: bool = False,
               decisions: DecisionSink | None = None) -> ChatFlow:
    """The chat flow of a live route (``batch`` False) or of a batch runner. ``pipelined``: the
    pipeline executor to use (default: the four-layer pipeline with review feedback recorded)."""
    from gateway.learning.perceive import FeedbackRecorder

    if pipelined is None:
        pipelined = PipelinedExecutor(settings, registry, feedback_sink=FeedbackRecorder(session_factory, settings))
    return ChatFlow(settings, direct=DirectExecutor(settings, registry), pipelined=pipelined,
                    admission=Admission(settings, budgets.budgets, budgets.rate_limiter), ledger=ledger,
                    decide_auto=decide_auto, rate_limited=not batch, park_rows=not batch, decisions=decisions)
