"""``Runtime``: the one typed composition root. Everything a serving process needs — database
sessions, the spend ledger, the key store, the provider registry, budgets, the classifier hook,
the chat flow and the batch-jobs backend — is built here, once, in one order, and closed in the
reverse order by ``open_runtime``. The FastAPI app (its lifespan), a Celery worker process and
the benches all open one; tests hand in small real parts through ``RuntimeParts`` instead.

Imports the gateway's building blocks; no FastAPI, no Celery.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Literal

from sqlalchemy.orm import Session, sessionmaker

from gateway.admin.throttle import LoginThrottle
from gateway.auth import KeyStore
from gateway.budgets import BudgetRuntime, build_budget_runtime
from gateway.chat.flow import ChatFlow
from gateway.chat.request import Executor
from gateway.chat.wiring import build_flow
from gateway.jobs.backends import JobsBackend, start_jobs
from gateway.learning.outcomes import DecisionLog
from gateway.ledger import Ledger
from gateway.providers.base import ChatProvider
from gateway.providers.metering import warm_up
from gateway.providers.openai_compat import SessionFactory
from gateway.providers.registry import ProviderRegistry
from gateway.routing import DecideAuto
from gateway.settings import Settings
from gateway.telemetry import metrics

Role = Literal["gateway", "worker"]


@dataclass(frozen=True)
class RuntimeParts:
    """Parts handed in instead of built (tests pass small real ones); a part handed in is also
    closed by its owner, not by the runtime."""

    session_factory: sessionmaker[Session] | None = None
    ledger: Ledger | None = None
    keys: KeyStore | None = None
    registry: ProviderRegistry | None = None
    budgets: BudgetRuntime | None = None
    pipelined: Executor | None = None  # the pipeline executor (default: the four-layer pipeline)
    decide_auto: DecideAuto | None = None  # the ``auto`` hook (default: the classifier, if one is found)
    http_session_factory: SessionFactory | None = None
    local_provider: ChatProvider | None = None


@dataclass(frozen=True)
class Runtime:
    settings: Settings
    session_factory: sessionmaker[Session]
    ledger: Ledger
    keys: KeyStore
    registry: ProviderRegistry
    budgets: BudgetRuntime
    decide_auto: DecideAuto | None
    decisions: DecisionLog | None  # the classifier's decisions, logged for learning (None: no classifier)
    flow: ChatFlow  # the live route's: budgets and rate limits in front
    jobs: JobsBackend | None  # None in a worker process (it runs batches, it does not submit them)
    admin_throttle: LoginThrottle  # failed admin credential checks per client address


def _session_factory(settings: Settings, stack: AsyncExitStack) -> sessionmaker[Session]:
    from gateway.db.session import engine_from_settings, make_session_factory

    engine = engine_from_settings(settings)
    stack.callback(engine.dispose)
    return make_session_factory(engine)


def _ledger(settings: Settings, sf: sessionmaker[Session], stack: AsyncExitStack) -> Ledger:
    led = Ledger(sf, settings.resolve_path(settings.ledger.journal_dir),
                 flush_interval_ms=settings.ledger.flush_interval_ms, batch_size=settings.ledger.batch_size,
                 interrupted_billing=settings.ledger.interrupted_billing, applier=settings.ledger.applier,
                 applier_nice=settings.ledger.applier_nice)
    led.start()  # replays what a dead process left in the journal, then settles its interrupted calls
    stack.push_async_callback(led.astop)  # closed last of all but the database: it drains first
    return led


async def _budgets(settings: Settings, sf: sessionmaker[Session], ledger: Ledger,
                   stack: AsyncExitStack) -> BudgetRuntime:
    await ledger.aflush()  # the counters load spend that includes a replayed journal
    await ledger.await_settled()  # ... and the interrupted calls of dead processes
    rt = build_budget_runtime(settings, sf)  # Redis counters when settings.redis has a URL
    await rt.start()
    stack.push_async_callback(rt.stop)
    return rt


async def _decide_auto(settings: Settings) -> DecideAuto | None:
    from gateway.learning.perceive import build_perceiver

    perceiver = await asyncio.to_thread(build_perceiver, settings)
    return perceiver.decide if perceiver is not None else None


def _observe(settings: Settings, ledger: Ledger, stack: AsyncExitStack, role: Role) -> None:
    """Metrics on (``observability.metrics.enabled``): every ledger record is counted as it is
    recorded, and a single-process gateway serves ``metrics.port`` if one is set (under several
    workers the supervising process does); this process's recording switch follows the setting
    until the runtime closes."""
    cfg = settings.observability.metrics
    was_on, was_labelled = metrics.enabled(), metrics.budget_series()
    metrics.configure(cfg.enabled, cfg.tenant_label)
    stack.callback(metrics.configure, was_on, was_labelled)
    if cfg.enabled:
        ledger.observer = metrics.LedgerMetrics(tenant_label=cfg.tenant_label)
        stack.callback(setattr, ledger, "observer", None)
        if cfg.port is not None and not metrics.multiprocess() and role == "gateway":
            stack.callback(metrics.serve_port(cfg.address, cfg.port))  # one process: it serves its own port
        if metrics.multiprocess():  # a worker that stops drops its live gauges (its counters stay summed)
            stack.callback(metrics.mark_dead, os.getpid())


@asynccontextmanager
async def open_runtime(settings: Settings, parts: RuntimeParts = RuntimeParts(), *,
                       role: Role = "gateway") -> AsyncIterator[Runtime]:
    """Build the runtime for this process; close what it built (in reverse) on exit."""
    async with AsyncExitStack() as stack:
        sf = parts.session_factory or _session_factory(settings, stack)
        ledger = parts.ledger or _ledger(settings, sf, stack)
        _observe(settings, ledger, stack, role)
        registry = parts.registry
        if registry is None:
            registry = ProviderRegistry(settings, http_session_factory=parts.http_session_factory,
                                        local_provider=parts.local_provider)
            stack.push_async_callback(registry.aclose)
        budgets = parts.budgets or await _budgets(settings, sf, ledger, stack)
        # The tokenizer that bills streams without usage: loaded off the loop, in the background.
        warm = asyncio.ensure_future(asyncio.to_thread(warm_up, list(settings.models.values())))
        stack.push_async_callback(lambda: warm)
        decide = parts.decide_auto if parts.decide_auto is not None else await _decide_auto(settings)
        decisions = None
        if decide is not None:  # the classifier's decisions are logged to be learned from
            decisions = DecisionLog(sf, settings)
            stack.callback(decisions.close)
        flow = build_flow(settings, registry, ledger, budgets, sf, decide_auto=decide, pipelined=parts.pipelined,
                          decisions=decisions)
        jobs = None
        if role == "gateway":  # batch lines: an in-process runner (embedded) or a Celery producer
            jobs = await start_jobs(settings, stack, session_factory=sf, registry=registry, budget_runtime=budgets,
                                    decide_auto=decide, ledger=ledger, pipelined=parts.pipelined,
                                    decisions=decisions)
        yield Runtime(settings=settings, session_factory=sf, ledger=ledger, keys=parts.keys or KeyStore(
            sf, ttl_s=settings.server.key_cache_ttl_s, stale_s=settings.server.key_cache_stale_s), registry=registry, budgets=budgets, decide_auto=decide, decisions=decisions,
            flow=flow, jobs=jobs, admin_throttle=LoginThrottle())
