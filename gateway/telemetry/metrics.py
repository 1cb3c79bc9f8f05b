"""Prometheus metrics: what is counted where, and the exposition for ``GET /metrics``.

Sources, each counted once, at the place that knows it:

* HTTP (``record_http``, from gateway.web.observe): requests and their latency, to the last
  byte of the answer (a stream's too), by route template, tier, primary model and status.
* Upstream calls (``record_attempt``, from gateway.providers.router): every attempt (retries
  and fallbacks included) by model and status, its latency, its errors by code.
* The ledger (``LedgerMetrics``, a ledger observer): every row the ledger records — upstream
  calls, tokens and cost (USD) by tier and model, requests by tier and status, budget and
  rate-limit refusals — so the counters equal the ledger's counts and sums. Per-tenant series
  only with ``observability.metrics.tenant_label``.
* The ledger's database writer (``record_flush``): batch latency, records written, the
  records waiting to be journaled / committed.

The request path does not call prometheus_client per sample: each thread adds to plain cells of
its own (gateway.telemetry.tallies' ``_Tallies``: a running total per labelled child — for a histogram one per bucket and the
sum — that only that thread writes), and ``fold`` adds what each cell gained since the last fold to
prometheus_client's values (a lock and a method call per child per fold, not per sample). A fold
runs before every exposition (so a scrape of this process sees every sample recorded before it),
every ``FOLD_INTERVAL_S`` in a daemon thread (so under several workers each worker's samples reach
the shared files within that time) and at exit. What a request costs is a dict lookup and an
addition per series instead of prometheus_client's checks and lock per sample
(``tiergate bench gateway``'s in-process table counts the difference).

Label values are bounded: route templates, tier names, configured model names, HTTP statuses,
error codes — never what a client typed (``model`` is the routed model, empty when a request
was refused before routing).

Several worker processes (``tiergate serve --workers N``): ``prepare_multiprocess`` points
prometheus_client's multiprocess mode at a directory before the workers start; each process
writes its samples there (memory-mapped files) and a scrape, answered by any worker, merges
them all (``exposition``). Names follow Prometheus conventions: ``_total`` counters,
``_seconds``, base units (USD for cost).

Imports prometheus_client, settings and gateway.telemetry.tallies only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from bisect import bisect_left
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from gateway.telemetry.tallies import (
    _add,
    _child,
    _Folder,
    _histogram,
    _tallies,
    _totals,
    fold,
)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
NANOS_PER_USD = 1_000_000_000
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
FLUSH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
REFUSAL_CODES = frozenset({"budget_exceeded", "rate_limit_exceeded"})

HTTP_REQUESTS = Counter("tiergate_http_requests", "HTTP requests answered, by route template, tier, routed model "
                        "and status.", ["route", "tier", "model", "status"])
HTTP_SECONDS = Histogram("tiergate_http_request_duration_seconds", "Time from the request's arrival to the last "
                         "byte of its answer.", ["route", "tier", "model", "status"], buckets=LATENCY_BUCKETS)
UPSTREAM_CALLS = Counter("tiergate_upstream_calls", "Upstream calls (every attempt), by model and status "
                         "(ok, error, cancelled).", ["model", "status"])
UPSTREAM_SECONDS = Histogram("tiergate_upstream_call_duration_seconds", "Upstream call latency (a stream's: to its "
                             "end), by model.", ["model"], buckets=LATENCY_BUCKETS)
UPSTREAM_ERRORS = Counter("tiergate_upstream_errors", "Failed upstream calls by model and error code.",
                          ["model", "code"])
LEDGER_CALLS = Counter("tiergate_ledger_calls", "Upstream calls recorded in the ledger, by tier, model, stage and "
                       "status.", ["tier", "model", "stage", "status"])
TOKENS = Counter("tiergate_tokens", "Tokens billed in the ledger, by tier, model and type (prompt, completion; "
                 "cached is part of prompt).", ["tier", "model", "type"])
COST = Counter("tiergate_cost_usd", "Spend recorded in the ledger in USD, by tier and model.", ["tier", "model"])
REQUESTS = Counter("tiergate_requests", "Requests recorded in the ledger, by tier and status (ok, error, "
                   "cancelled).", ["tier", "status"])
REFUSALS = Counter("tiergate_refusals", "Requests refused by a budget or a rate limit.", ["reason"])
TENANT_TOKENS = Counter("tiergate_tenant_tokens", "Tokens billed per tenant (observability.metrics.tenant_label).",
                        ["tenant", "type"])
TENANT_COST = Counter("tiergate_tenant_cost_usd", "Spend per tenant in USD (observability.metrics.tenant_label).",
                      ["tenant"])
FLUSH_SECONDS = Histogram("tiergate_ledger_db_flush_duration_seconds", "Time to write one batch of ledger records "
                          "to the database.", buckets=FLUSH_BUCKETS)
FLUSHED = Counter("tiergate_ledger_db_flushed_records", "Ledger records written to the database.")
FLUSH_FAILURES = Counter("tiergate_ledger_db_flush_failures", "Failed database writes of ledger batches (retried).")
PENDING = Gauge("tiergate_ledger_pending_records", "Ledger records not yet journaled (stage=journal) or not yet in "
                "the database (stage=db), summed over live processes.", ["stage"], multiprocess_mode="livesum")
BUDGET_UTILISATION = Gauge("tiergate_budget_utilisation_ratio", "Spend in the current period over the hard limit "
                           "(or the soft one when it is the only limit), per budget subject "
                           "(observability.metrics.tenant_label).", ["scope", "subject"],
                           multiprocess_mode="mostrecent")
WORKER = Gauge("tiergate_worker_up", "1 per live gateway process (with a pid label under several workers).",
               multiprocess_mode="liveall")

_state = {"on": True, "tenant_label": False}


def enabled() -> bool:
    return _state["on"]


def configure(on: bool, tenant_label: bool = False) -> None:
    """Turn recording on or off in this process (``observability.metrics.enabled``), and the
    per-tenant series (``tenant_label``)."""
    _state["on"], _state["tenant_label"] = on, on and tenant_label
    if on:
        WORKER.set(1)
        _Folder.ensure()


# -- recording ------------------------------------------------------------------------------------
# Each event below is one function call: its series' totals are found with one lookup of the
# event's labels in this thread's shortcuts and added to inline (what ``_add`` / ``_observe`` do
# one series at a time). The request path's Python calls are what metrics cost a server.
def record_http(route: str, tier: str, model: str, status: int, seconds: float) -> None:
    """One request: its count and its latency."""
    shortcuts = _tallies.http
    hit = shortcuts.get((route, tier, model, status))
    if hit is None:
        s = str(status)
        hit = shortcuts[(route, tier, model, status)] = (
            _totals((HTTP_REQUESTS, route, tier, model, s)), *_histogram((HTTP_SECONDS, route, tier, model, s)))
    count, latency, bounds = hit
    count[0] += 1
    latency[bisect_left(bounds, seconds)] += 1
    latency[-1] += seconds


class AttemptLike(Protocol):
    @property
    def model_name(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def latency_ms(self) -> int | float: ...
    @property
    def error(self) -> Any: ...


def record_attempt(attempt: AttemptLike) -> None:
    if _state["on"]:
        _record_attempt(attempt.model_name, attempt.status, attempt.latency_ms, attempt.error)


def _record_attempt(name: str, status: str, latency_ms: float, error: Any) -> None:
    shortcuts = _tallies.attempts
    hit = shortcuts.get((name, status))
    if hit is None:
        hit = shortcuts[(name, status)] = (_totals((UPSTREAM_CALLS, name, status)),
                                           *_histogram((UPSTREAM_SECONDS, name)))
    calls, latency, bounds = hit
    calls[0] += 1
    seconds = latency_ms / 1000
    latency[bisect_left(bounds, seconds)] += 1
    latency[-1] += seconds
    if status == "error":
        _add((UPSTREAM_ERRORS, name, str(getattr(error, "code", None) or "error")))


def observed(on_attempt: Callable[[Any], None]) -> Callable[[Any], None]:
    """``on_attempt`` that counts each attempt first."""
    def both(attempt: Any) -> None:
        if _state["on"]:
            _record_attempt(attempt.model_name, attempt.status, attempt.latency_ms, attempt.error)
        on_attempt(attempt)
    return both


def budget_series() -> bool:
    """Whether per-subject budget utilisation is recorded (metrics on, ``tenant_label`` on)."""
    return _state["tenant_label"]


def observe_budget(scope: str, subject: str, spent_nanos: int, limit_nanos: int | None,
                   soft_limit_nanos: int | None) -> None:
    base = limit_nanos if limit_nanos is not None else soft_limit_nanos
    if base and _state["tenant_label"]:
        _child(BUDGET_UTILISATION, scope, subject).set(spent_nanos / base)


class LedgerMetrics:
    """The ledger's observer (``Ledger.observer``): counts each record as it is recorded."""

    def __init__(self, tenant_label: bool = False) -> None:
        self.tenant_label = tenant_label

    def entry(self, e: Any) -> None:  # a gateway.ledger.LedgerEntry
        if not _state["on"]:
            return
        u, tier, model = e.usage, e.tier, e.model
        shortcuts = _tallies.entries
        hit = shortcuts.get((tier, model, e.stage, e.status))
        if hit is None:
            hit = shortcuts[(tier, model, e.stage, e.status)] = (
                _totals((LEDGER_CALLS, tier, model, e.stage, e.status)), _totals((TOKENS, tier, model, "prompt")),
                _totals((TOKENS, tier, model, "completion")), _totals((COST, tier, model)))
        calls, prompt, completion, cost = hit
        calls[0] += 1
        prompt[0] += u.prompt_tokens
        completion[0] += u.completion_tokens
        cost[0] += e.cost_nanos / NANOS_PER_USD
        if self.tenant_label:
            _add((TENANT_TOKENS, e.tenant_id, "prompt"), u.prompt_tokens)
            _add((TENANT_TOKENS, e.tenant_id, "completion"), u.completion_tokens)
            _add((TENANT_COST, e.tenant_id), e.cost_nanos / NANOS_PER_USD)

    def request(self, r: Any) -> None:  # a gateway.ledger.RequestRecord
        status = r.status
        if not _state["on"] or status == "in_progress":  # counted once, when it ends
            return
        shortcuts = _tallies.requests
        totals = shortcuts.get((r.tier, status))
        if totals is None:
            totals = shortcuts[(r.tier, status)] = _totals((REQUESTS, r.tier, status))
        totals[0] += 1
        if r.error_code in REFUSAL_CODES:
            _add((REFUSALS, r.error_code))

    def flush(self, seconds: float, records: int, pending_journal: int, pending_db: int) -> None:
        if not _state["on"]:
            return
        FLUSH_SECONDS.observe(seconds)
        FLUSHED.inc(records)
        _child(PENDING, "journal").set(pending_journal)
        _child(PENDING, "db").set(pending_db)

    def flush_failed(self) -> None:
        if _state["on"]:
            FLUSH_FAILURES.inc()


# -- several processes ----------------------------------------------------------------------------
def prepare_multiprocess(directory: str | None) -> Path:
    """Before the workers start: point ``PROMETHEUS_MULTIPROC_DIR`` at ``directory`` (emptied of
    earlier runs' samples) or at a fresh temporary directory; the workers inherit it. Returns
    the directory (``cleanup_multiprocess`` removes a temporary one)."""
    if directory:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        for old in path.glob("*.db"):
            old.unlink()
    else:
        path = Path(tempfile.mkdtemp(prefix="tiergate-metrics-"))
    os.environ[MULTIPROC_ENV] = str(path)
    return path


def cleanup_multiprocess(path: Path, configured: str | None) -> None:
    if configured is None:
        shutil.rmtree(path, ignore_errors=True)


def multiprocess() -> bool:
    """Whether this process writes its samples for a multiprocess scrape (several workers)."""
    return bool(os.environ.get(MULTIPROC_ENV))


def mark_dead(pid: int) -> None:
    """Drop a stopping worker's live gauges (its counters stay in the sums). A worker killed
    outright keeps its ``tiergate_worker_up`` / pending-records series until the next run."""
    fold()  # this worker's last samples into its files first
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def serve_port(address: str, port: int) -> Callable[[], None]:
    """Serve the exposition (this process's samples, or every worker's under multiprocess mode)
    on ``address:port`` from a daemon thread; returns the function that stops it."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(_Default())  # type: ignore[arg-type]
    server, thread = start_http_server(port, addr=address, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)
    return stop


class _Default:
    """This process's registry, as one collector."""

    def collect(self) -> Iterable[Any]:
        fold()
        return REGISTRY.collect()


def exposition(extra: Iterable[Collector] = ()) -> tuple[bytes, str]:
    """The text exposition: every process's samples (merged under several workers) plus
    ``extra`` collectors (database-backed gauges, the engine's)."""
    fold()  # this process's samples, to the last one recorded
    registry = CollectorRegistry(auto_describe=False)
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(_Default())  # type: ignore[arg-type]
    for collector in extra:
        registry.register(collector)
    return generate_latest(registry), CONTENT_TYPE_LATEST
