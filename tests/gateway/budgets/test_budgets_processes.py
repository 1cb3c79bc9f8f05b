"""Budgets and rate limits across two real gateway processes (`tiergate serve`) sharing one
PostgreSQL database and one Redis: the 64-vs-10 concurrency test, a rate limit shared by both,
and kill -9 of one process under load (no lost or double-counted ledger row, stale
reservations released after the lease, ledger == Redis counter == upstream usage × price)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import yaml
from redis.asyncio import Redis

from gateway.auth import generate_key, hash_key
from gateway.budgets import put_policy, window_for
from gateway.budgets.redis_backend import RedisCounters
from gateway.db.models import LedgerEntryRow
from gateway.db.queries import add_api_key, create_tenant
from gateway.money import usd_to_nanos
from gateway.providers.base import CALL_ID_HEADER
from tests.gateway.budgets_support import migrated_db
from tests.gateway.scripted_upstream import (
    Behaviour,
    ScriptedUpstream,
    config_for,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow, pytest.mark.process]
# An empty message: 11 prompt tokens by the gateway's hold bound (3 + 8 per message + its bytes)
# and by the scripted upstream (10 + 1 message), so each hold equals what the call costs.
BODY = {"model": "low", "messages": [{"role": "user", "content": ""}], "max_tokens": 4}
COST = Decimal(11 * 1 + 4 * 2) / Decimal(10**6)  # 11 prompt tokens at $1/M + 4 completion at $2/M
LEASE_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """Two `tiergate serve` processes, each with its own config file and journal."""

    def __init__(self, tmp: Path, upstream: ScriptedUpstream, pg_url: str, redis_url: str, prefix: str) -> None:
        self.tmp, self.redis_url = tmp, redis_url
        self.ports = [_free_port(), _free_port()]
        self.procs: list[subprocess.Popen[bytes] | None] = [None, None]
        self.configs = []
        for i in range(2):
            cfg: dict[str, Any] = config_for(upstream.base_url, db_url=pg_url, journal_dir=f"journal{i}")
            cfg["redis"] = {"url_env": "TIERGATE_TEST_BUDGET_REDIS_URL", "key_prefix": prefix}
            cfg["budgets"] = {"reservation_lease_s": LEASE_S}
            path = tmp / f"config{i}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            self.configs.append(path)

    def start(self, *which: int) -> None:
        """Launch the given processes at once, then wait until each answers /readyz."""
        for i in which:
            env = {**os.environ, "TIERGATE_CONFIG": str(self.configs[i]),
                   "TIERGATE_TEST_BUDGET_REDIS_URL": self.redis_url}
            log = self.tmp / f"serve{i}.log"
            self.procs[i] = subprocess.Popen(
                [sys.executable, "-c", "from gateway.cli import main; main()", "serve",
                 "--config", str(self.configs[i]), "--port", str(self.ports[i])],
                env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
        for i in which:
            self._wait_ready(i)

    def _wait_ready(self, i: int) -> None:
        proc, log = self.procs[i], self.tmp / f"serve{i}.log"
        assert proc is not None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{self.ports[i]}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("gateway did not become ready:\n" + log.read_text()[-3000:])

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}/v1/chat/completions"


def _tenant(sf: Any, name: str, **policy: Any) -> tuple[str, str]:
    raw = generate_key()
    with sf() as s, s.begin():
        tenant = create_tenant(s, name)
        add_api_key(s, tenant.id, raw, hash_key(raw))
        if policy:
            put_policy(s, scope="tenant", tenant_id=tenant.id, **policy)
        return tenant.id, raw


def _ledger(sf: Any, tenant_id: str) -> list[LedgerEntryRow]:
    with sf() as s:
        return list(s.scalars(sa.select(LedgerEntryRow).where(LedgerEntryRow.tenant_id == tenant_id)))


def _wait_rows(sf: Any, tenant_id: str, n: int | Callable[[list[LedgerEntryRow]], bool],
               timeout: float = 20) -> list[LedgerEntryRow]:
    """The tenant's rows once there are ``n`` (or ``n(rows)`` holds), or at ``timeout``."""
    done = n if callable(n) else (lambda rows: len(rows) >= n)
    deadline = time.monotonic() + timeout
    while True:
        rows = _ledger(sf, tenant_id)
        if done(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


async def _post(client: httpx.AsyncClient, url: str, key: str) -> tuple[int, dict[str, Any], httpx.Headers]:
    r = await client.post(url, json=BODY, headers={"Authorization": f"Bearer {key}"})
    return r.status_code, r.json(), r.headers


def test_two_processes_share_budget_and_rate_limit(tmp_path: Path, upstream: ScriptedUpstream, postgres_url: str,
                                                   redis_url: str, redis_prefix: str) -> None:
    sf = migrated_db(postgres_url)
    budget_tenant, budget_key = _tenant(sf, "budgeted", period="day", limit_usd=COST * Decimal("10.5"))
    rl_tenant, rl_key = _tenant(sf, "limited", requests_per_min=10)
    cluster = Cluster(tmp_path, upstream, postgres_url, redis_url, redis_prefix)
    try:
        cluster.start(0, 1)

        async def scenario() -> tuple[list[Any], list[Any], list[Any], float]:
            async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=128)) as c:
                burst = await asyncio.gather(*(_post(c, cluster.url(i % 2), budget_key) for i in range(64)))
                after = [await _post(c, cluster.url(i % 2), budget_key) for i in range(4)]
                start = time.monotonic()
                limited = [await _post(c, cluster.url(i % 2), rl_key) for i in range(30)]
                return burst, after, limited, time.monotonic() - start

        burst, after, limited, took_s = asyncio.run(scenario())
        codes = [r[0] for r in burst]
        assert codes.count(200) == 10 and codes.count(429) == 54, codes
        assert {r[1]["error"]["code"] for r in burst if r[0] == 429} == {"budget_exceeded"}
        assert {r[0] for r in after} == {429}  # denied stays denied, on both processes
        rows = _wait_rows(sf, budget_tenant, 10)
        assert len(rows) == 10 and sum((r.cost_usd for r in rows), Decimal(0)) == 10 * COST

        # 10/min for the tenant, not per process: a burst of 10, then one more every 6 s of the run
        allowed = [r[0] for r in limited].count(200)
        assert 10 <= allowed <= 10 + int(took_s // 6), (allowed, took_s)
        refused = [r for r in limited if r[0] == 429]
        assert len(refused) == 30 - allowed and all(r[1]["error"]["code"] == "rate_limit_exceeded" for r in refused)
        assert all(1 <= int(r[2]["retry-after"]) <= 60 for r in refused)
        assert len(_wait_rows(sf, rl_tenant, allowed)) == allowed
    finally:
        cluster.stop()


def test_kill9_under_load_loses_nothing_and_counts_once(tmp_path: Path, upstream: ScriptedUpstream,
                                                        postgres_url: str, redis_url: str, redis_prefix: str) -> None:
    sf = migrated_db(postgres_url)
    tenant, key = _tenant(sf, "busy", period="month", limit_usd=Decimal(1))
    upstream.push(*[Behaviour(hang_s=0.05)] * 2000)  # upstream calls take a while: some are in flight
    cluster = Cluster(tmp_path, upstream, postgres_url, redis_url, redis_prefix)
    results: list[tuple[int, dict[str, Any]]] = []
    try:
        cluster.start(0, 1)

        async def load(stop_at: float, i: int) -> None:
            async with httpx.AsyncClient(timeout=30) as c:
                while time.monotonic() < stop_at:
                    try:
                        code, body, _ = await _post(c, cluster.url(i % 2), key)
                        results.append((code, body))
                    except httpx.HTTPError:
                        results.append((-1, {}))
                        await asyncio.sleep(0.05)

        async def scenario() -> None:
            end = time.monotonic() + 4.0
            workers = [asyncio.create_task(load(end, i)) for i in range(16)]
            await asyncio.sleep(1.5)
            await asyncio.to_thread(cluster.kill, 0)  # kill -9 mid-load
            await asyncio.gather(*workers)

        asyncio.run(scenario())
        cluster.start(0)  # restart: replays its journal
    finally:
        cluster.stop()

    ok = [body for code, body in results if code == 200]
    assert len(ok) > 20 and any(code == -1 for code, _ in results)  # real load, and the kill cut requests
    # Each upstream call carries its ledger row's id (X-Client-Request-Id): match them one by one.
    sent = Counter(r.headers.get(CALL_ID_HEADER) for r in upstream.requests)
    assert None not in sent and max(sent.values()) == 1, sent.most_common(3)
    rows = _wait_rows(sf, tenant, lambda rows: set(sent) <= {r.id for r in rows}, timeout=5)
    by_request: dict[str, list[LedgerEntryRow]] = {}
    for row in rows:
        by_request.setdefault(row.request_id, []).append(row)
    # No lost row: every answered request is in the ledger with exactly the usage it reported.
    for body in ok:
        [row] = by_request[body["id"]]
        assert (row.prompt_tokens, row.completion_tokens) == (body["usage"]["prompt_tokens"],
                                                              body["usage"]["completion_tokens"])
    # Exactly one row per upstream call (one call per request here): the calls in flight at the
    # kill are settled from their journaled intents as ``interrupted`` when the process restarts.
    assert set(sent) <= {r.id for r in rows} and all(len(v) == 1 for v in by_request.values())
    # A row no call reached the upstream for: an intent journaled just before the kill whose request
    # had not left yet. The restarted process cannot know that it never left, so it bills it as
    # interrupted (the documented policy); nothing else may have a row without a call.
    unsent = [r for r in rows if r.id not in sent]
    assert all(r.status == "interrupted" for r in unsent) and len(unsent) <= 16, [
        (r.status, r.prompt_tokens, r.completion_tokens) for r in unsent]
    print(f"kill9: {len(results)} requests, {len(ok)} answered, {len(sent)} upstream calls, {len(rows)} ledger "
          f"rows ({len(unsent)} interrupted before their request left)")
    ledger_total = sum((r.cost_usd for r in rows), Decimal(0))
    usage_total = sum((Decimal(r.prompt_tokens * 1 + r.completion_tokens * 2) / 10**6 for r in rows), Decimal(0))
    finished = [r for r in rows if r.status != "interrupted"]
    assert ledger_total == usage_total
    assert sum((r.cost_usd for r in finished), Decimal(0)) == COST * len(finished)

    async def counters() -> tuple[int, int]:
        client = Redis.from_url(redis_url)
        try:
            await asyncio.sleep(LEASE_S + 0.5)  # the dead process's holds outlive it by one lease
            rc = RedisCounters(client, sf, prefix=redis_prefix, log_window_ms=1000, reconcile_interval_s=0)
            await rc.reconcile()
            month = window_for("month", datetime.now(UTC))
            spent, held = await client.hmget(f"{redis_prefix}budget:tenant:{tenant}|{month.key}", "spent", "held")
            return int(spent), int(held)
        finally:
            async for k in client.scan_iter(match=redis_prefix + "*"):
                await client.delete(k)
            await client.aclose()

    spent, held = asyncio.run(counters())
    assert held == 0  # stale reservations released after the lease
    assert spent == usd_to_nanos(ledger_total)  # counter == sum(ledger) == usage × price, to the nano-dollar
