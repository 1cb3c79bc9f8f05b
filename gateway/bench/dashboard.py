"""`tiergate bench dashboard`: every admin console page at scale on PostgreSQL.

A temporary database beside ``--postgres-url`` gets ``--tenants`` tenants (3 keys each, a budget
on every tenth, an alert and an audit row on some) and ``--rows`` requests, each with one ledger
row, spread over 90 days, COPYed in; ``daily_spend`` is built from the ledger; the tables are
vacuumed and analysed, as autovacuum would after the load. The real app
(create_app, as ``tiergate serve`` builds it: ``freeze_heap=True``, so full garbage collections
skip the startup heap) then answers each console page ``--repeats`` times
in-process (httpx over ASGI: no socket, so the time is the server's): the overview (HTML and
JSON), a tenant page (HTML and JSON, a different tenant each time), a tenant's keys and the
audit log. The overview reads the rollups of daily_spend (``tenant_spend_spans``,
``daily_tier_spend``), built here from it as the ledger applier maintains them; after timing,
the overview's numbers are checked equal to a plain aggregate of daily_spend, and the overview's
spend read is timed against that aggregate as it ran before the rollups (GROUPING SETS over the
window's daily_spend rows), interleaved, with the ratio printed. Printed per page: p50 and p99 (target: p99 <= 200 ms at 1M rows and 1,000 tenants),
and the ratio of its p50 to the baseline measured in the same run: the login page, which
renders a template and touches no database (the floor of a console page). The database is
dropped after. Numbers taken on a shared, busy machine are noisy; compare ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from gateway.bench.ledger_pg import FullCollections, NullLedger, SleepingUpstream, _pct, _settings
from gateway.db.rollups import SPANS

DAYS = 90
TIERS = ("low", "medium", "high")
ADMIN_ENV = "TIERGATE_BENCH_DASHBOARD_ADMIN_KEY"


def seed(url: str, tenants: int, rows: int) -> float:
    """COPY tenants, keys, requests and ledger rows; build daily_spend; add budgets, alerts and
    audit rows; VACUUM (ANALYZE). Seconds taken."""
    import psycopg

    t0 = time.perf_counter()
    dsn = sa.engine.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    now = datetime.now(UTC)
    start = now - timedelta(days=DAYS)
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        with cur.copy("COPY tenants (id, name, created_at, allow_prompt_storage) FROM STDIN") as copy:
            for t in range(tenants):
                copy.write_row((f"ten_{t:05d}", f"tenant {t:05d}", start, False))
        with cur.copy("COPY api_keys (id, tenant_id, name, prefix, key_hash, created_at) FROM STDIN") as copy:
            for t in range(tenants):
                for k in range(3):
                    copy.write_row((f"key_{t:05d}_{k}", f"ten_{t:05d}", f"k{k}", f"tg-{t:05d}{k}",
                                    uuid.uuid4().hex + uuid.uuid4().hex, start))
        with cur.copy("COPY requests (id, tenant_id, key_id, requested_model, tier, effort_source, pipeline, status, "
                      "http_status, latency_ms, prompt_tokens, completion_tokens, cost_usd, baseline_cost_usd, "
                      "created_at) FROM STDIN") as copy:
            for i in range(rows):
                t = i % tenants
                ts = start + timedelta(seconds=(i * 7919) % (DAYS * 86400))
                refused = i % 50 == 0
                copy.write_row((f"req_{i}", f"ten_{t:05d}", f"key_{t:05d}_{i % 3}", "auto", TIERS[i % 3], "classifier",
                                i % 7 == 0, "error" if refused else "ok", 429 if refused else 200, 5.0 + i % 300,
                                100 + i % 50, 20 + i % 10, "0" if refused else f"0.000{100 + i % 900}",
                                "0" if refused else "0.001000000", ts))
        with cur.copy("COPY ledger_entries (id, request_id, tenant_id, key_id, stage, tier, model, prompt_tokens, "
                      "cached_tokens, completion_tokens, reasoning_tokens, cost_usd, baseline_cost_usd, status, "
                      "created_at) FROM STDIN") as copy:
            for i in range(rows):
                if i % 50 == 0:
                    continue  # refused: no upstream call
                t = i % tenants
                ts = start + timedelta(seconds=(i * 7919) % (DAYS * 86400))
                copy.write_row((uuid.uuid4().hex, f"req_{i}", f"ten_{t:05d}", f"key_{t:05d}_{i % 3}", "direct",
                                TIERS[i % 3], "bench", 100 + i % 50, 0, 20 + i % 10, 0, f"0.000{100 + i % 900}",
                                "0.001000000", "ok", ts))
        cur.execute(
            "INSERT INTO daily_spend (tenant_id, day, model, tier, requests, prompt_tokens, cached_tokens, "
            "completion_tokens, reasoning_tokens, cost_usd, baseline_cost_usd) "
            "SELECT tenant_id, (created_at AT TIME ZONE 'UTC')::date, model, tier, count(*), sum(prompt_tokens), "
            "sum(cached_tokens), sum(completion_tokens), sum(reasoning_tokens), sum(cost_usd), "
            "sum(baseline_cost_usd) FROM ledger_entries GROUP BY 1, 2, 3, 4")
        # the overview's rollups of daily_spend, as the ledger applier maintains them (gateway.db.rollups)
        cur.execute(
            "INSERT INTO tenant_spend_spans (span_days, start_day, tenant_id, requests, prompt_tokens, "
            "completion_tokens, cost_usd, baseline_cost_usd) "
            "SELECT s.n, d.day - ((d.day - DATE '1970-01-01') %% s.n), d.tenant_id, sum(requests), sum(prompt_tokens), "
            "sum(completion_tokens), sum(cost_usd), sum(baseline_cost_usd) "
            "FROM daily_spend d CROSS JOIN unnest(%s::int[]) AS s(n) GROUP BY 1, 2, 3", (list(SPANS),))
        cur.execute(
            "INSERT INTO daily_tier_spend (day, tier, requests, prompt_tokens, completion_tokens, cost_usd, "
            "baseline_cost_usd) SELECT day, tier, sum(requests), sum(prompt_tokens), sum(completion_tokens), "
            "sum(cost_usd), sum(baseline_cost_usd) FROM daily_spend GROUP BY 1, 2")
        for t in range(0, tenants, 10):
            cur.execute("INSERT INTO budgets (id, scope, tenant_id, period, limit_usd, updated_at) "
                        "VALUES (%s, 'tenant', %s, 'month', 5, %s)", (f"tenant:ten_{t:05d}", f"ten_{t:05d}", now))
            cur.execute("INSERT INTO budget_alerts (id, subject, tenant_id, period_key, threshold_permille, spent_usd, "
                        "limit_usd, created_at, attempts) VALUES (%s, %s, %s, %s, 500, 2.5, 5, %s, 0)",
                        (f"alert_{t}", f"tenant:ten_{t:05d}", f"ten_{t:05d}", now.strftime("%Y-%m"), now))
            cur.execute("INSERT INTO admin_audit (id, created_at, actor, client, action, target, tenant_id, after) "
                        "VALUES (%s, %s, 'bearer', '127.0.0.1', 'budget.set', %s, %s, %s)",
                        (f"aud_{t}", now, f"tenant:ten_{t:05d}", f"ten_{t:05d}", '{"limit_usd": "5"}'))
    # What autovacuum does after a bulk load (PostgreSQL's default; a server may run with it off):
    # statistics for the planner, and the visibility map that lets index-only scans skip the heap.
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        for table in ("tenants", "api_keys", "requests", "ledger_entries", "daily_spend", "tenant_spend_spans",
                      "daily_tier_spend", "budgets"):
            cur.execute(f"VACUUM (ANALYZE) {table}")
    return time.perf_counter() - t0


async def _time_pages(app: Any, admin_key: str, tenants: int, repeats: int,
                      pauses: FullCollections | None = None) -> dict[str, list[float]]:
    """Each page ``repeats`` times, interleaved; seconds per request. ``pauses`` is entered for
    the timed requests only (not startup, whose heap freeze runs one full collection)."""
    import httpx

    bearer = {"Authorization": f"Bearer {admin_key}"}
    pages: dict[str, Callable[[int], tuple[str, dict[str, str]]]] = {
        "login page (baseline: no database)": lambda i: ("/admin/login", {}),
        "overview (HTML)": lambda i: ("/admin", {}),
        "overview (JSON)": lambda i: ("/admin/api/overview", bearer),
        "tenant page (HTML)": lambda i: (f"/admin/tenants/ten_{(i * 37) % tenants:05d}", {}),
        "tenant (JSON)": lambda i: (f"/admin/api/tenants/ten_{(i * 41) % tenants:05d}", bearer),
        "tenant keys (JSON)": lambda i: (f"/admin/api/tenants/ten_{(i * 43) % tenants:05d}/keys", bearer),
        "audit log (JSON)": lambda i: ("/admin/api/audit", bearer),
    }
    out: dict[str, list[float]] = {name: [] for name in pages}
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                     base_url="http://bench") as client:
        r = await client.post("/admin/login", data={"admin_key": admin_key})
        if r.status_code != 303:
            raise RuntimeError(f"admin login failed: {r.status_code}")
        for name, page in pages.items():  # warm-up: caches, counters, plans
            path, headers = page(0)
            r = await client.get(path, headers=headers)
            if r.status_code != 200:
                raise RuntimeError(f"{name}: {path} answered {r.status_code}")
        with pauses if pauses is not None else contextlib.nullcontext():
            for i in range(repeats):
                for name, page in pages.items():  # interleaved, so no page always runs on a quieter machine
                    path, headers = page(i + 1)
                    t0 = time.perf_counter()
                    r = await client.get(path, headers=headers)
                    out[name].append(time.perf_counter() - t0)
                    if r.status_code != 200:
                        raise RuntimeError(f"{name}: {path} answered {r.status_code}")
    return out


def check_overview_sums(sf: Any) -> int:
    """The overview's per-tenant and per-day numbers (from the rollups) equal a plain aggregate of
    daily_spend over the same 30-day window, to the nano-dollar; the tenants compared."""
    from gateway.db import admin_queries as aq
    from gateway.db.models import DailySpend

    until = datetime.now(UTC).date()
    since = until - timedelta(days=29)
    with sf() as s:
        tenants, day_tier = aq.overview_spend(s, since, until)
        got = {t.tenant_id: (t.totals.calls, t.totals.cost_usd, t.totals.baseline_cost_usd) for t in tenants}
        want = {r[0]: (int(r[1]), r[2], r[3]) for r in s.execute(
            sa.select(DailySpend.tenant_id, sa.func.sum(DailySpend.requests), sa.func.sum(DailySpend.cost_usd),
                      sa.func.sum(DailySpend.baseline_cost_usd))
            .where(DailySpend.day >= since, DailySpend.day <= until).group_by(DailySpend.tenant_id))}
        days = {(r[0], r[1]): r[2] for r in s.execute(
            sa.select(DailySpend.day, DailySpend.tier, sa.func.sum(DailySpend.cost_usd))
            .where(DailySpend.day >= since, DailySpend.day <= until).group_by(DailySpend.day, DailySpend.tier))}
    if {k: v for k, v in got.items() if v[0]} != want:
        raise RuntimeError("overview per-tenant spend (rollup) differs from daily_spend")
    if {(d, t): v.cost_usd for d, tiers in day_tier.items() for t, v in tiers.items()} != days:
        raise RuntimeError("overview per-day spend (rollup) differs from daily_spend")
    return len(want)


def _daily_spend_overview(s: Any, since: Any, until: Any) -> int:
    """The baseline: the overview's spend read as it was before the rollups, one GROUPING SETS
    aggregate of daily_spend's rows in the window (per tenant, and per day and tier), and the
    tenants' names (as ``overview_spend`` reads them too)."""
    from gateway.db import admin_queries as aq
    from gateway.db.models import DailySpend as D

    sums = [sa.func.sum(D.requests), sa.func.sum(D.prompt_tokens), sa.func.sum(D.completion_tokens),
            sa.func.sum(D.cost_usd), sa.func.sum(D.baseline_cost_usd)]
    q = (sa.select(sa.func.grouping(D.day), D.tenant_id, D.day, D.tier, *sums)
         .where(D.day >= since, D.day <= until)
         .group_by(sa.func.grouping_sets(sa.tuple_(D.tenant_id), sa.tuple_(D.day, D.tier))))
    return len(s.execute(q).all()) + len(aq.list_tenants(s))


def time_spend_reads(sf: Any, repeats: int) -> tuple[list[float], list[float]]:
    """The overview's spend reads (30-day window) from the rollups vs the daily_spend baseline,
    interleaved; seconds per read."""
    from gateway.db import admin_queries as aq

    until = datetime.now(UTC).date()
    since = until - timedelta(days=29)
    rollup: list[float] = []
    base: list[float] = []
    gc.collect()
    gc.freeze()  # as in the served app: full collections skip what was alive before (cf. create_app)
    try:
        with sf() as s:
            aq.overview_spend(s, since, until)
            _daily_spend_overview(s, since, until)
            for _ in range(repeats):
                t0 = time.perf_counter()
                aq.overview_spend(s, since, until)
                rollup.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                _daily_spend_overview(s, since, until)
                base.append(time.perf_counter() - t0)
    finally:
        gc.unfreeze()
    return rollup, base


def run(admin_url: str, tenants: int, rows: int, repeats: int, *, keep: bool = False) -> list[str]:
    """Create a temp database, seed it, time every page, drop it (``keep``: leave it, for
    EXPLAIN and profiling; its URL is the last line); returns the report lines."""
    from gateway.app import create_app
    from gateway.auth import KeyStore
    from gateway.db.migrate import upgrade
    from gateway.db.session import make_engine, make_session_factory
    from gateway.runtime import RuntimeParts

    name = f"tiergate_bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = admin_url.rsplit("/", 1)[0] + "/" + name
    key = uuid.uuid4().hex
    old = os.environ.get("TIERGATE_ADMIN_KEY")
    try:
        upgrade(url)
        seconds = seed(url, tenants, rows)
        os.environ["TIERGATE_ADMIN_KEY"] = key
        engine = make_engine(url, pool_size=10)
        sf = make_session_factory(engine)
        with tempfile.TemporaryDirectory(prefix="tiergate-bench-dashboard-") as tmp:
            settings = _settings(Path(tmp), url)
            ledger: Any = NullLedger()  # nothing is recorded while pages are read
            app = create_app(settings, RuntimeParts(session_factory=sf, ledger=ledger, keys=KeyStore(sf),
                                                    local_provider=SleepingUpstream(0.0)), freeze_heap=True)
            pauses = FullCollections()
            times = asyncio.run(_time_pages(app, key, tenants, repeats, pauses))
        checked = check_overview_sums(sf)
        reads = time_spend_reads(sf, repeats)
        engine.dispose()
    finally:
        if old is None:
            os.environ.pop("TIERGATE_ADMIN_KEY", None)
        else:
            os.environ["TIERGATE_ADMIN_KEY"] = old
        if not keep:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    base = statistics.median(next(iter(times.values())))
    lines = [f"dashboard: {tenants} tenants, {rows} requests (+ ledger rows, daily_spend) seeded by COPY in "
             f"{seconds:.1f} s; {repeats} timed requests per page, in-process (server time)"]
    worst = 0.0
    for page, samples in times.items():
        p50, p99 = statistics.median(samples) * 1000, _pct(samples, 0.99) * 1000
        if not page.startswith("login"):
            worst = max(worst, p99)
        lines.append(f"  {page:<36} p50 {p50:8.2f} ms  p99 {p99:8.2f} ms  p50 x{p50 / (base * 1000):.1f} of the baseline")
    lines.append(f"  worst console page p99: {worst:.2f} ms (target <= 200 ms at 1M rows, 1,000 tenants)")
    lines.append(f"  full garbage collections while timed: {len(pauses.pauses_ms)}, longest "
                 f"{max(pauses.pauses_ms, default=0.0):.1f} ms (startup heap frozen, as `tiergate serve` does)")
    (r50, r99), (b50, b99) = ((statistics.median(x) * 1000, _pct(x, 0.99) * 1000) for x in reads)
    lines.append(f"  overview spend read, 30 days: rollups p50 {r50:.2f} ms p99 {r99:.2f} ms; daily_spend aggregate "
                 f"(before the rollups) p50 {b50:.2f} ms p99 {b99:.2f} ms; p50 ratio aggregate/rollups x{b50 / r50:.1f}")
    lines.append(f"  overview numbers (rollups) equal daily_spend's sums exactly for {checked} tenants and every "
                 "day x tier of the 30-day window")
    if keep:
        lines.append(f"  database kept (drop it when done): {sa.engine.make_url(url).render_as_string(hide_password=True)}")
    else:
        lines.append(f"  database {name} dropped")
    return lines
