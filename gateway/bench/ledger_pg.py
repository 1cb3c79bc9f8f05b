"""`tiergate bench ledger`: the ledger at scale on PostgreSQL, ratios measured in one run.

Part 1, serving. The real app (create_app: auth, budgets, chat flow, direct executor), built
as ``tiergate serve`` builds it (``freeze_heap=True``), answers chat requests from an
in-process upstream that sleeps ``--upstream-ms`` per call, in two kinds of phase with the same
workload: *baseline* with a ledger that drops every record, and *ledger on* with the real
journaled ``Ledger`` writing to PostgreSQL. ``--rounds`` rounds run the two in ABBA order (off
on, on off, ...), so neither kind always runs first or on a warmer machine. Every phase starts
from the same state: the ledger drained, a fresh app whose lifespan collects and freezes the
heap, its own 20-request warm-up. During both kinds a second process (another replica's
``Ledger``) records ``--extra-rows-per-s`` entries into the same database, so the phases differ
only in this process's own ledger. The rounds run twice, in the two shapes of
gateway.bench.ledger_load: first *closed loop* (``--concurrency`` workers, at saturation: the
ledger's cost in throughput, which a saturated server can only show as queueing), then *open
loop* at ``--open-fractions`` of the open loop's capacity without a ledger (Poisson arrivals, the
same schedule for both kinds, latency counted from each request's scheduled time): the latency
clients see at a load the server keeps up with, which the target is about. That capacity is
measured, not taken from the closed loop (an open loop costs the loop thread more per request, so
a share of the closed loop's throughput can be a saturated open loop whose p99 is its queue):
short ledger-off open loops bisect for the highest rate whose answers keep up with the arrivals
(gateway.bench.ledger_load.sustainable_rate); each probe and each phase prints its offered and
achieved rate. For each: ledger rows/s committed to PostgreSQL during the timed ledger-on phases
(this process's and the other replica's, each shown); the
request p50/p99 of both kinds (all rounds pooled); the p99 ratio on/off as the median of the
rounds' ratios, so one disturbed phase cannot set it (target, open loop: ≥ 2,000 rows/s, p99
ratio ≤ 1.10), with a distribution-free 95% interval of that median (the rounds' order
statistics: gateway.bench.intervals.median_interval), so a run says whether its rounds settle the
target (met: the whole interval at or below it; NOT met: all above; else not settled — a round's
ratio swings by ±30% on a shared 2-core machine, and 12 rounds resolve the median to about ±8%),
each round's ratio and the pooled one; and the full (generation-2) garbage
collections that paused the loop while timed, so a stall like the one these used to cause
(every in-flight request, ~150 ms) shows instead of silently setting a p99. Per phase
(gateway.bench.stalls): its longest stall (requests in flight, none completing) with the p99 of
the requests it did not hold, and its worst event-loop lag split into the loop thread's time on
a CPU and waiting for one (other processes had the cores: the phase measured the machine, not
the gateway).

Part 2, reading spend. ``--seed-rows`` ledger rows are COPYed into the temp database and
``daily_spend`` is built from them; then the spend summary (one tenant, 30 days, by day,
model and tier, from daily_spend) is timed against the same summary computed from the raw
ledger (target: ≤ 200 ms). Everything runs in a temporary database that is dropped after.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import tempfile
import time
import uuid
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from gateway.bench.intervals import interval_verdict, median_interval
from gateway.bench.ledger_calls import loop_cpu_line, timed_calls_phase
from gateway.bench.ledger_load import (
    FullCollections,
    NullLedger,
    Phase,
    Probe,
    SleepingUpstream,
    judge_probe,
    serve_phase,
    sustainable_rate,
)
from gateway.bench.ledger_load import pct as _pct
from gateway.bench.stalls import Stall, longest_stall, overlapping

SUMMARY_DAYS = 30
# The open-loop phases' offered loads, as shares of the ledger-off open-loop capacity (one set of
# ABBA rounds each): what the ledger costs a client's latency at a moderate and at a busy load.
OPEN_FRACTIONS = (0.3, 0.6)
# The open-loop capacity probes: ledger-off open loops of this many seconds each, from the closed
# loop's ledger-off throughput up by PROBE_GROW while they keep up, then bisecting PROBE_STEPS
# times (down to PROBE_LOW of the closed loop's throughput).
PROBE_S = 3.0
PROBE_LOW, PROBE_GROW, PROBE_STEPS = 0.2, 1.25, 4
EXTRA_TENANT = "bench-extra"  # the other replica's rows
P99_TARGET = 1.10  # the open loop's p99 ratio, ledger on / off

__all__ = ["FullCollections", "NullLedger", "Phase", "SleepingUpstream", "run"]


def _settings(workdir: Path, db_url: str) -> Any:
    from gateway.settings import settings_from_dict

    model = {"provider": "local", "model": "bench", "price": {"input": 0.5, "output": 1.5}}
    return settings_from_dict({
        "database": {"url_env": "TIERGATE_BENCH_UNSET_DB_URL", "default_url": db_url},
        "redis": {"url_env": "TIERGATE_BENCH_UNSET_REDIS_URL"},
        "models": {"bench": model},
        "tiers": {t: {"model": "bench"} for t in ("none", "minimal", "low", "medium", "high", "xhigh")},
    }, base_dir=workdir)


def _batching() -> tuple[int, int]:
    """(flush_interval_ms, batch_size): the ledger's batching as a server built from the defaults
    has it (ledger.flush_interval_ms, ledger.batch_size), for both replicas."""
    from gateway.settings import LedgerSettings

    d = LedgerSettings()
    return d.flush_interval_ms, d.batch_size


def _extra_replica(url: str, journal_dir: str, rate: float, stop: Any) -> None:
    """Another gateway replica's ledger: its own process, Ledger and journal, same database."""
    from gateway.db.session import make_engine, make_session_factory
    from gateway.ledger import Ledger, LedgerEntry, new_entry_id
    from gateway.providers.base import Usage

    engine = make_engine(url)
    ledger = Ledger(make_session_factory(engine), journal_dir, *_batching())
    ledger.start()
    t0, sent = time.perf_counter(), 0
    while not stop.is_set():
        due = int((time.perf_counter() - t0) * rate)
        for _ in range(due - sent):
            ledger.record(LedgerEntry(new_entry_id(), "req_bench_extra", EXTRA_TENANT, None, "execute", "low",
                                      "bench", Usage(100, 20), 100_000, 1_000_000))
        sent = max(sent, due)
        time.sleep(0.005)
    if not ledger.stop(120):
        raise RuntimeError("the extra replica's ledger did not drain")
    engine.dispose()


def run_serving(url: str, workdir: Path, n: int, concurrency: int, upstream_ms: float,
                extra_rows_per_s: float, rounds: int = 2,
                open_fractions: tuple[float, ...] = OPEN_FRACTIONS) -> dict[str, Any]:
    from gateway.app import create_app
    from gateway.auth import KeyStore, generate_key, hash_key
    from gateway.db.queries import add_api_key, create_tenant
    from gateway.db.session import make_engine, make_session_factory
    from gateway.ledger import Ledger
    from gateway.runtime import RuntimeParts

    settings = _settings(workdir, url)
    engine = make_engine(url, pool_size=10)
    sf = make_session_factory(engine)
    raw = generate_key()
    with sf() as s, s.begin():
        tenant = create_tenant(s, "bench")
        add_api_key(s, tenant.id, raw, hash_key(raw))
    upstream = SleepingUpstream(upstream_ms / 1000)

    def app_with(ledger: Any) -> Any:
        return create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf), local_provider=upstream), freeze_heap=True)

    # The other replica writes its ledger rows during both phases: the phases differ only in
    # this process's own ledger (off: a ledger that drops everything; on: the real one).
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    replica = ctx.Process(target=_extra_replica, args=(url, str(workdir / "journal-extra"), extra_rows_per_s, stop))
    replica.start()
    try:
        time.sleep(3.0)  # let the replica import and reach its steady rate
        ledger = Ledger(sf, workdir / "journal", *_batching())
        ledger.start()
        closed = _rounds(app_with, ledger, sf, raw, n, rounds, concurrency, None)
        closed_rps = statistics.median(p.achieved_rps for p in closed["phases"] if p.kind == "off")
        # Open loop at a share of the open loop's own capacity without a ledger: the highest Poisson
        # rate a ledger-off loop keeps up with (gateway.bench.ledger_load.sustainable_rate). Not the
        # closed loop's throughput: an open loop costs the loop thread more per request (fewer
        # requests per loop iteration, a task and a timer per arrival), so a share of the closed
        # loop's rate can be a saturated open loop, whose p99 is its growing queue.
        capacity, probes = 0.0, list[Probe]()
        if any(f > 0 for f in open_fractions):
            seeds = iter(range(100, 200))  # each probe its own schedule, none the phases' own (seeds 0..rounds)

            def probe(rate: float) -> Probe:
                phase = asyncio.run(serve_phase(app_with(NullLedger()), raw, max(200, int(rate * PROBE_S)),
                                                concurrency, FullCollections(), "probe", 0, rate=rate,
                                                seed=next(seeds)))
                return judge_probe(rate, phase.spans)

            capacity, probes = sustainable_rate(probe, closed_rps, PROBE_LOW * closed_rps, grow=PROBE_GROW,
                                                steps=PROBE_STEPS)
        opened = [(f, f * capacity, _rounds(app_with, ledger, sf, raw, n, rounds, concurrency, f * capacity))
                  for f in open_fractions if f > 0]
        calls = timed_calls_phase(app_with, ledger, raw, max(1, n // rounds), concurrency,
                              next((f * capacity for f in open_fractions if f > 0), None))
    finally:  # the replica never outlives the bench, whatever happened
        stop.set()
        replica.join(180)
        if replica.is_alive():
            replica.kill()
    assert ledger.flush(120), "ledger did not drain"
    ledger.stop()
    engine.dispose()
    if replica.exitcode != 0:
        raise RuntimeError(f"the extra ledger replica failed (exit code {replica.exitcode})")
    return {"closed": closed, "open": opened, "capacity_rps": capacity, "closed_rps": closed_rps, "probes": probes,
            "calls": calls,
            "switch_interval_ms": max(p.switch_interval_s for p in closed["phases"]) * 1000}


def _committed(sf: Any) -> tuple[int, int]:
    """Ledger rows in the database: (this process's, the other replica's)."""
    from gateway.db.models import LedgerEntryRow

    extra = LedgerEntryRow.tenant_id == EXTRA_TENANT
    with sf() as s:
        own, other = s.execute(sa.select(sa.func.count().filter(~extra), sa.func.count().filter(extra))).one()
    return int(own), int(other)


def _rounds(app_with: Any, ledger: Any, sf: Any, raw: str, n: int, rounds: int, concurrency: int,
            rate: float | None) -> dict[str, Any]:
    """``rounds`` ABBA rounds of a ledger-off and a ledger-on phase (closed loop, or open loop at
    ``rate``); every ledger-on phase's rows are committed before the next phase starts. Rows
    committed while serving are counted per process and kind of phase: this process's during its
    ledger-on phases, the other replica's during both kinds."""
    per_phase = max(1, n // rounds)
    base: list[float] = []
    on: list[float] = []
    round_p99_ms: list[tuple[float, float]] = []
    phases: list[Phase] = []
    pauses = {"off": FullCollections(), "on": FullCollections()}
    own_rows, extra_rows = 0, {"off": 0, "on": 0}
    serve_s = {"off": 0.0, "on": 0.0}
    for i in range(rounds):
        latencies: dict[str, list[float]] = {}
        for kind in ("off", "on") if i % 2 == 0 else ("on", "off"):  # ABBA
            own0, extra0 = _committed(sf)
            t0 = time.perf_counter()
            phase = asyncio.run(serve_phase(app_with(NullLedger() if kind == "off" else ledger), raw, per_phase,
                                            concurrency, pauses[kind], kind, i + 1, rate=rate, seed=i))
            serve_s[kind] += time.perf_counter() - t0
            own1, extra1 = _committed(sf)
            phases.append(phase)
            latencies[kind] = phase.latencies
            extra_rows[kind] += extra1 - extra0
            if kind == "on":
                own_rows += own1 - own0
                # Drain this phase's rows before the next phase, so no phase pays for the
                # ledger-on phase's tail of writes.
                assert ledger.flush(120), "ledger did not drain"
        base += latencies["off"]
        on += latencies["on"]
        round_p99_ms.append((_pct(latencies["off"], 0.99) * 1000, _pct(latencies["on"], 0.99) * 1000))
    on_s = serve_s["on"]
    return {"rows": own_rows + extra_rows["on"], "serve_s": on_s, "rows_per_s": (own_rows + extra_rows["on"]) / on_s,
            "own_rows_per_s": own_rows / on_s, "extra_rows_per_s": extra_rows["on"] / on_s,
            "extra_off_rows_per_s": extra_rows["off"] / serve_s["off"],
            "base_p50_ms": statistics.median(base) * 1000, "base_p99_ms": _pct(base, 0.99) * 1000,
            "on_p50_ms": statistics.median(on) * 1000, "on_p99_ms": _pct(on, 0.99) * 1000,
            "requests": per_phase * rounds, "rounds": rounds, "round_p99_ms": round_p99_ms, "phases": phases,
            "off_gc_pauses_ms": pauses["off"].pauses_ms, "on_gc_pauses_ms": pauses["on"].pauses_ms,
            "gc": {k: v.summary() for k, v in pauses.items()}}


def seed_ledger(url: str, rows: int, tenants: int = 50, days: int = 90) -> float:
    """COPY ``rows`` ledger rows (spread over tenants and days), then build daily_spend. Seconds."""
    import psycopg

    t0 = time.perf_counter()
    dsn = sa.engine.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    start = datetime.now(UTC) - timedelta(days=days)
    models = ("bench-a", "bench-b")
    tiers = ("low", "medium", "high")
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        with cur.copy("COPY ledger_entries (id, request_id, tenant_id, key_id, stage, tier, model, prompt_tokens, "
                      "cached_tokens, completion_tokens, reasoning_tokens, cost_usd, baseline_cost_usd, status, "
                      "created_at) FROM STDIN") as copy:
            for i in range(rows):
                ts = start + timedelta(seconds=(i * 7919) % (days * 86400))
                copy.write_row((uuid.uuid4().hex, f"req_{i}", f"tenant-{i % tenants}", f"key-{i % (tenants * 3)}",
                                "direct", tiers[i % 3], models[i % 2], 100 + i % 50, 0, 20 + i % 10, 0,
                                f"0.000{100 + i % 900}", "0.001000000", "ok", ts))
        cur.execute(
            "INSERT INTO daily_spend (tenant_id, day, model, tier, requests, prompt_tokens, cached_tokens, "
            "completion_tokens, reasoning_tokens, cost_usd, baseline_cost_usd) "
            "SELECT tenant_id, (created_at AT TIME ZONE 'UTC')::date, model, tier, count(*), sum(prompt_tokens), "
            "sum(cached_tokens), sum(completion_tokens), sum(reasoning_tokens), sum(cost_usd), "
            "sum(baseline_cost_usd) FROM ledger_entries WHERE tenant_id LIKE 'tenant-%' GROUP BY 1, 2, 3, 4")
        cur.execute("ANALYZE ledger_entries")
        cur.execute("ANALYZE daily_spend")
    return time.perf_counter() - t0


_RAW_SUMMARY = sa.text(
    "SELECT (created_at AT TIME ZONE 'UTC')::date AS day, model, tier, count(*), sum(prompt_tokens), "
    "sum(completion_tokens), sum(cost_usd), sum(baseline_cost_usd) FROM ledger_entries "
    "WHERE tenant_id = :tenant AND created_at >= :since AND created_at < :until GROUP BY 1, 2, 3 ORDER BY 1, 2, 3")


def time_summaries(url: str, repeats: int = 50, tenants: int = 50) -> dict[str, float]:
    from gateway.budgets import spend_summary
    from gateway.db.session import make_engine, make_session_factory

    engine = make_engine(url)
    sf = make_session_factory(engine)
    until = date.today() + timedelta(days=1)
    since = until - timedelta(days=SUMMARY_DAYS)
    fast: list[float] = []
    raw: list[float] = []
    with sf() as s:
        for i in range(repeats):
            tenant = f"tenant-{i % tenants}"
            t0 = time.perf_counter()
            a = spend_summary(s, tenant, since, until)
            fast.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b = s.execute(_RAW_SUMMARY, {"tenant": tenant, "since": datetime.combine(since, datetime.min.time(), UTC),
                                         "until": datetime.combine(until, datetime.min.time(), UTC)}).all()
            raw.append(time.perf_counter() - t0)
            if sum(r["cost_usd"] for r in a) != sum(r[6] for r in b):
                raise RuntimeError("spend summary from daily_spend disagrees with the raw ledger")
    engine.dispose()
    return {"summary_p50_ms": statistics.median(fast) * 1000, "summary_p99_ms": _pct(fast, 0.99) * 1000,
            "raw_p50_ms": statistics.median(raw) * 1000, "raw_p99_ms": _pct(raw, 0.99) * 1000}


def phase_line(phase: Phase) -> str:
    """A phase's p99, its longest stall (with the p99 of the requests that did not overlap it) and
    its worst event-loop lag."""
    lat = phase.latencies
    stall = longest_stall(phase.spans, phase.origin) or Stall(0.0, 0.0, 0)
    clear = [x for x, hit in zip(lat, overlapping(phase.spans, stall, phase.origin), strict=True) if not hit]
    without = f"{_pct(clear, 0.99) * 1000:.2f} ms" if clear else "-"
    lag = phase.loop_lag
    cpu_s, queued_s = phase.loop_sched
    wall_s = max((e for _, e in phase.spans), default=phase.origin) - phase.origin
    rate = (f"offered {phase.offered_rps:.0f}/s, achieved {phase.achieved_rps:.0f}/s" if phase.offered_rps
            else f"achieved {phase.achieved_rps:.0f}/s")
    return (f"    round {phase.round} ledger {phase.kind + ':':<4} {rate}, p99 {_pct(lat, 0.99) * 1000:6.2f} ms, "
            f"{without} without its longest stall: {stall.duration_s * 1000:.0f} ms at {stall.start_s:.2f} s "
            f"({stall.in_flight} in flight); loop lag max {lag.lag_s * 1000:.0f} ms at {lag.at_s:.2f} s "
            f"(loop thread meanwhile: {lag.on_cpu_s * 1000:.0f} ms on a CPU, {lag.run_queue_s * 1000:.0f} ms "
            f"waiting for one); phase {wall_s:.2f} s, loop thread {cpu_s:.2f} s on a CPU, {queued_s:.2f} s "
            f"waiting for one")


BUSY_SHARE = 0.10  # a ledger-off phase whose loop thread waited for a CPU longer than this share of it


def _queued_share(phase: Phase) -> float:
    wall_s = max((e for _, e in phase.spans), default=phase.origin) - phase.origin
    return phase.loop_sched[1] / wall_s if wall_s > 0 else 0.0


def busy_line(phases: list[Phase]) -> str:
    """How long the loop thread waited for a CPU, as a share of each phase (max per kind). The
    ledger-off phases run only this loop, the other replica and PostgreSQL for it: more than
    ``BUSY_SHARE`` there means other processes had the cores and the p99s measured the machine."""
    worst = {kind: max((_queued_share(p) for p in phases if p.kind == kind), default=0.0) for kind in ("off", "on")}
    busy = sum(1 for p in phases if p.kind == "off" and _queued_share(p) > BUSY_SHARE)
    verdict = (f"BUSY MACHINE: {busy} ledger-off phase(s) above {BUSY_SHARE:.0%}, other processes had the cores; "
               "rerun on an idle machine" if busy else f"ledger-off phases within {BUSY_SHARE:.0%}")
    return (f"  loop thread waiting for a CPU, max share of a phase: ledger off {worst['off']:.0%}, ledger on "
            f"{worst['on']:.0%} ({verdict})")


def _pauses_text(pauses_ms: list[float]) -> str:
    return f"{len(pauses_ms)} (max {max(pauses_ms, default=0.0):.1f} ms)"


def _block(r: dict[str, Any], title: str, *, target: bool) -> list[str]:
    """The report of one set of ABBA rounds (``target``: the p99 ratio is held to the target)."""
    ratios = [on_ms / off_ms for off_ms, on_ms in r["round_p99_ms"]]
    low, high, coverage = median_interval(ratios)
    if target:
        verdict = (f"target <= {P99_TARGET:.2f}; {coverage:.0%} interval of the median from the rounds' order statistics "
                   f"{low:.3f}..{high:.3f}: {interval_verdict(low, high, coverage, P99_TARGET)}")
    else:
        verdict = (f"no target: the latency of a saturated server is its queue; {coverage:.0%} interval "
                   f"{low:.3f}..{high:.3f}")
    return [
        f"{title}: {r['requests']:.0f} chat requests per kind of phase (ledger off, on) in {r['rounds']} ABBA rounds",
        f"  ledger rows committed to PostgreSQL while serving (ledger-on phases, this process + 1 extra replica): "
        f"{r['rows']:.0f} in {r['serve_s']:.2f} s = {r['rows_per_s']:.0f} rows/s (target >= 2000): this process "
        f"{r['own_rows_per_s']:.0f} rows/s, the other replica {r['extra_rows_per_s']:.0f} rows/s (during the "
        f"ledger-off phases: {r['extra_off_rows_per_s']:.0f} rows/s)",
        f"  request latency, ledger off (baseline): p50 {r['base_p50_ms']:.2f} ms  p99 {r['base_p99_ms']:.2f} ms",
        f"  request latency, ledger on:             p50 {r['on_p50_ms']:.2f} ms  p99 {r['on_p99_ms']:.2f} ms",
        f"  p99 ratio on/off: {statistics.median(ratios):.3f} (median of the rounds; {verdict})",
        f"  p99 ratio on/off per round: {'  '.join(f'{x:.3f}' for x in ratios)}; all rounds pooled: "
        f"{r['on_p99_ms'] / r['base_p99_ms']:.3f}",
        loop_cpu_line(r["phases"]),
        f"  full GC pauses while timed: ledger off {_pauses_text(r['off_gc_pauses_ms'])}, "
        f"ledger on {_pauses_text(r['on_gc_pauses_ms'])}",
        f"  all garbage collections while timed, ledger off: {r['gc']['off']}",
        f"  all garbage collections while timed, ledger on:  {r['gc']['on']}",
        "  per phase (stall: the longest time with requests in flight and none completing, and the p99 of "
        "the requests it did not hold; loop lag: how late a 5 ms sleeper woke; 'waiting for a CPU': the loop "
        "thread runnable while other processes had the cores):",
        *(phase_line(p) for p in r["phases"]),
        busy_line(r["phases"]),
    ]


def run(admin_url: str, n: int, concurrency: int, upstream_ms: float, extra_rows_per_s: float,
        seed_rows: int, rounds: int = 2, open_fractions: tuple[float, ...] = OPEN_FRACTIONS) -> list[str]:
    """Create a temp database, run both parts, drop it; returns the report lines."""
    from gateway.db.migrate import upgrade

    name = f"tiergate_bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = admin_url.rsplit("/", 1)[0] + "/" + name
    lines: list[str] = []
    try:
        upgrade(url)
        with tempfile.TemporaryDirectory(prefix="tiergate-bench-ledger-pg-") as tmp:
            r = run_serving(url, Path(tmp), n, concurrency, upstream_ms, extra_rows_per_s, rounds, open_fractions)
        lines.append(
            f"serving: concurrency {concurrency} (closed loop), upstream {upstream_ms:g} ms, extra ledger load "
            f"{extra_rows_per_s:g} rows/s from another replica's process; the app built as `tiergate serve` "
            f"builds it (startup heap frozen, GIL switch interval {r['switch_interval_ms']:g} ms)")
        lines += _block(r["closed"], "closed loop at saturation (each worker sends its next request when answered: "
                        "what the ledger costs in throughput, shown as latency)", target=False)
        if r["probes"]:
            lines.append(
                f"open-loop capacity without a ledger: {r['capacity_rps']:.0f} requests/s, the highest Poisson rate "
                f"a ledger-off open loop kept up with (achieved >= {Probe.KEEP_UP:.0%} of offered, the first and "
                f"the last quarter's median latency <= {Probe.BACKLOG:g} x the probe's fastest answer + "
                f"{Probe.BACKLOG_SLACK_S * 1000:g} ms), "
                f"probed from the closed loop's {r['closed_rps']:.0f}/s (up x{PROBE_GROW:g} while kept up, then "
                f"bisected {PROBE_STEPS} times; a rate that falls behind is probed again, a disturbance can only "
                f"make a probe fail), {PROBE_S:g} s a probe:")
            lines += [f"  probe {i} at {p.rate:.0f}/s: {p.line()}" for i, p in enumerate(r["probes"], 1)]
        for fraction, rate, opened in r["open"]:
            lines += _block(opened, f"open loop at {rate:.0f} requests/s = {fraction:.0%} of the "
                            f"{r['capacity_rps']:.0f}/s open-loop capacity without a ledger (Poisson arrivals, "
                            "same schedule for both kinds, latency from each request's scheduled time: what a "
                            "client sees at that load)", target=True)
        lines += r["calls"]
        seconds = seed_ledger(url, seed_rows)
        t = time_summaries(url)
        lines += [
            f"reading: {seed_rows} ledger rows seeded by COPY (+ daily_spend) in {seconds:.1f} s",
            f"  spend summary (daily_spend, 1 tenant, {SUMMARY_DAYS} days): p50 {t['summary_p50_ms']:.2f} ms  "
            f"p99 {t['summary_p99_ms']:.2f} ms (target <= 200 ms)",
            f"  same summary from the raw ledger (baseline): p50 {t['raw_p50_ms']:.2f} ms  p99 {t['raw_p99_ms']:.2f} ms",
            f"  speed-up vs raw ledger (p50): x{t['raw_p50_ms'] / t['summary_p50_ms']:.1f}",
        ]
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    return lines
