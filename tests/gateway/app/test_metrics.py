"""GET /metrics after a scripted workload through the real app (SQLite, the real ledger, the
scripted upstream): the counters equal the ledger's counts and sums; refusals are counted;
the scrape is admin-protected by default, open with ``auth: none``, absent when disabled."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.app.observe_support import app_with
from tests.gateway.edge.edge_support import free_port
from tests.gateway.scripted_upstream import Behaviour, ScriptedUpstream

ADMIN = "admin-key-for-metrics-tests"
MSGS = [{"role": "user", "content": "hi"}]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(client: httpx.AsyncClient, key: str | None = ADMIN) -> Samples:
    r = await client.get("/metrics", headers={"authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(after: Samples, before: Samples, name: str, **match: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Per label set: how much sample ``name`` (with labels ``match``) grew."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for (n, labels), value in after.items():
        if n == name and all(dict(labels).get(k) == v for k, v in match.items()):
            grown = value - before.get((n, labels), 0.0)
            if grown:
                out[labels] = grown
    return out


def by(rows: dict[tuple[tuple[str, str], ...], float], *keys: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for labels, value in rows.items():
        d = dict(labels)
        out[tuple(d[k] for k in keys)] += value
    return dict(out)


async def test_counters_equal_the_ledger(tmp_path: Path, upstream: ScriptedUpstream,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_ADMIN_KEY", ADMIN)
    async with app_with(tmp_path, upstream) as gw:
        before = await scrape(gw.client)
        for body in ({"model": "tier-low", "messages": MSGS, "max_tokens": 3},
                     {"model": "medium", "messages": MSGS, "max_tokens": 5},
                     {"model": "tier-low", "messages": MSGS, "stream": True}):
            r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json=body)
            assert r.status_code == 200, r.text
        upstream.push(Behaviour(status=500), Behaviour(status=500))  # two failed attempts, then ok
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "tier-medium", "messages": MSGS, "max_tokens": 2})
        assert r.status_code == 200
        r = await gw.client.post("/v1/messages", headers={"x-api-key": gw.key},
                                 json={"model": "low", "max_tokens": 4, "messages": MSGS})
        assert r.status_code == 200
        r = await gw.client.post("/v1/chat/completions", headers={"authorization": "Bearer tg-nope-123456789"},
                                 json={"model": "low", "messages": MSGS})
        assert r.status_code == 401
        rows, requests = gw.ledger_rows(), gw.request_rows()
        after = await scrape(gw.client)

    assert len(rows) == 7
    calls = delta(after, before, "tiergate_ledger_calls_total")
    expected_calls: dict[tuple[str, ...], float] = defaultdict(float)
    prompt: dict[tuple[str, ...], float] = defaultdict(float)
    completion: dict[tuple[str, ...], float] = defaultdict(float)
    cost: dict[tuple[str, ...], float] = defaultdict(float)
    for row in rows:
        expected_calls[(row.tier, row.model, row.stage, row.status)] += 1
        prompt[(row.tier, row.model)] += row.prompt_tokens
        completion[(row.tier, row.model)] += row.completion_tokens
        cost[(row.tier, row.model)] += float(row.cost_usd)
    assert by(calls, "tier", "model", "stage", "status") == dict(expected_calls)
    assert by(delta(after, before, "tiergate_tokens_total", type="prompt"), "tier", "model") == dict(prompt)
    assert by(delta(after, before, "tiergate_tokens_total", type="completion"), "tier", "model") == dict(completion)
    got_cost = by(delta(after, before, "tiergate_cost_usd_total"), "tier", "model")
    assert got_cost.keys() == cost.keys() and all(got_cost[k] == pytest.approx(cost[k]) for k in cost)

    req_expected: dict[tuple[str, ...], float] = defaultdict(float)
    for q in requests:
        req_expected[(q.tier, q.status)] += 1
    assert by(delta(after, before, "tiergate_requests_total"), "tier", "status") == dict(req_expected)

    upstream_calls = by(delta(after, before, "tiergate_upstream_calls_total"), "model", "status")
    assert sum(upstream_calls.values()) == len(rows) and upstream_calls[("up-a", "error")] == 2
    assert by(delta(after, before, "tiergate_upstream_errors_total"), "model", "code") == {("up-a", "upstream_error"): 2}
    assert sum(delta(after, before, "tiergate_upstream_call_duration_seconds_count").values()) == len(rows)

    http = by(delta(after, before, "tiergate_http_requests_total"), "route", "tier", "model", "status")
    assert http == {("/v1/chat/completions", "low", "up-a", "200"): 2, ("/v1/chat/completions", "medium", "up-a", "200"): 2,
                    ("/v1/messages", "low", "up-a", "200"): 1, ("/v1/chat/completions", "", "", "401"): 1,
                    ("/metrics", "", "", "200"): 1}  # the first scrape, counted once it was answered
    assert sum(delta(after, before, "tiergate_http_request_duration_seconds_count").values()) == 7
    assert ("tiergate_batch_lines", (("state", "pending"),)) in after
    assert after[("tiergate_ledger_db_flushed_records_total", ())] > before.get(
        ("tiergate_ledger_db_flushed_records_total", ()), 0)


async def test_refusals_are_counted(tmp_path: Path, upstream: ScriptedUpstream,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_ADMIN_KEY", ADMIN)
    async with app_with(tmp_path / "rl", upstream, budgets={"requests_per_min": 1}) as gw:
        before = await scrape(gw.client)
        codes = [(await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                       json={"model": "low", "messages": MSGS, "max_tokens": 2})).status_code
                 for _ in range(3)]
        after = await scrape(gw.client)
    assert codes.count(429) >= 1
    refused = delta(after, before, "tiergate_refusals_total")
    assert refused == {(("reason", "rate_limit_exceeded"),): codes.count(429)}

    async with app_with(tmp_path / "budget", upstream, budgets={"limit_usd": 0.000001}) as gw:
        before = await scrape(gw.client)
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "low", "messages": MSGS, "max_tokens": 500})
        after = await scrape(gw.client)
    assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded"
    assert delta(after, before, "tiergate_refusals_total") == {(("reason", "budget_exceeded"),): 1}


async def test_scrape_auth_and_switches(tmp_path: Path, upstream: ScriptedUpstream,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_ADMIN_KEY", ADMIN)
    async with app_with(tmp_path / "a", upstream) as gw:
        assert (await gw.client.get("/metrics")).status_code == 401
        assert (await gw.client.get("/metrics", headers={"authorization": "Bearer wrong"})).status_code == 401
    async with app_with(tmp_path / "b", upstream, observability={"metrics": {"auth": "none"}}) as gw:
        assert "tiergate_http_requests_total" in str(await scrape(gw.client, key=None))
    async with app_with(tmp_path / "c", upstream, observability={"metrics": {"enabled": False}}) as gw:
        assert (await gw.client.get("/metrics", headers={"authorization": f"Bearer {ADMIN}"})).status_code == 404
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth, json={"model": "low", "messages": MSGS})
        assert r.status_code == 200
    assert gw.ledger.observer is None


@pytest.mark.integration  # a real listener on a loopback port
@pytest.mark.slow  # ~3 s: the listener stops on its 0.5 s poll
async def test_separate_port_serves_the_samples_unauthenticated(tmp_path: Path, upstream: ScriptedUpstream) -> None:
    port = free_port()
    async with app_with(tmp_path, upstream, observability={"metrics": {"port": port}}) as gw:
        r = await gw.client.post("/v1/chat/completions", headers=gw.auth,
                                 json={"model": "low", "messages": MSGS, "max_tokens": 2})
        assert r.status_code == 200
        async with httpx.AsyncClient() as plain:
            scraped = (await plain.get(f"http://127.0.0.1:{port}/metrics")).text
        assert "tiergate_http_requests_total" in scraped and "tiergate_ledger_calls_total" in scraped
    with pytest.raises(httpx.ConnectError):  # stopped with the app
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)


async def test_tenant_series_only_when_asked(tmp_path: Path, upstream: ScriptedUpstream,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_ADMIN_KEY", ADMIN)
    body = {"model": "low", "messages": MSGS, "max_tokens": 3}
    async with app_with(tmp_path / "on", upstream, budgets={"limit_usd": 1.0},
                        observability={"metrics": {"tenant_label": True}}) as gw:
        before = await scrape(gw.client)
        for _ in range(2):
            assert (await gw.client.post("/v1/chat/completions", headers=gw.auth, json=body)).status_code == 200
        after = await scrape(gw.client)
        rows = gw.ledger_rows()
    spent = sum(float(r.cost_usd) for r in rows)
    tenant = (("tenant", gw.tenant_id),)
    assert delta(after, before, "tiergate_tenant_cost_usd_total")[tenant] == pytest.approx(spent)
    assert delta(after, before, "tiergate_tenant_tokens_total", type="completion") == {
        (("tenant", gw.tenant_id), ("type", "completion")): sum(r.completion_tokens for r in rows)}
    ratio = after[("tiergate_budget_utilisation_ratio", (("scope", "tenant"), ("subject", f"tenant:{gw.tenant_id}")))]
    assert ratio == pytest.approx(spent / 1.0)

    async with app_with(tmp_path / "off", upstream, budgets={"limit_usd": 1.0}) as gw:
        before = await scrape(gw.client)
        assert (await gw.client.post("/v1/chat/completions", headers=gw.auth, json=body)).status_code == 200
        after = await scrape(gw.client)
    assert not any(gw.tenant_id in str(labels) for (_, labels) in after)


def test_tallies_fold_into_what_direct_calls_record() -> None:
    """The request path's tallies (per-thread totals, folded into prometheus_client's values) give
    the samples prometheus_client's own inc/observe give: every bucket edge (a value equal to a
    bound is in that bucket), +Inf, several threads, samples after a fold folded once."""
    import threading

    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.exposition import generate_latest

    from gateway.telemetry import metrics, tallies

    def family(registry: CollectorRegistry) -> tuple[Counter, Histogram]:
        return (Counter("t_c", "c", ["k"], registry=registry),
                Histogram("t_h", "h", ["k"], buckets=metrics.LATENCY_BUCKETS, registry=registry))

    tallied, direct = CollectorRegistry(), CollectorRegistry()
    (tc, th), (dc, dh) = family(tallied), family(direct)
    values = [0.0, 0.005, 0.0050001, 0.01, 0.3, 7.0, 600.0, 1000.0]  # edges, between, above the last bound

    def record(k: str, vs: list[float]) -> None:
        for v in vs:
            tallies._add((tc, k), v)
            tallies._observe((th, k), v)

    def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
        return {(s.name, str(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples
                if not s.name.endswith("_created")}

    record("a", values)
    threads = [threading.Thread(target=record, args=("b", values * 50)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, vs in (("a", values), *[("b", values * 50)] * 3):
        for v in vs:
            dc.labels(k).inc(v)
            dh.labels(k).observe(v)
    tallies.fold()
    tallies.fold()  # nothing more
    record("a", [0.02, 0.02])
    dc.labels("a").inc(0.04)
    for v in (0.02, 0.02):
        dh.labels("a").observe(v)
    tallies.fold()
    got, want = samples(tallied), samples(direct)
    assert got.keys() == want.keys() and len(want) > 30
    assert all(got[k] == pytest.approx(want[k], rel=1e-12) for k in want), [k for k in want if got[k] != want[k]]


def test_a_series_that_only_ever_got_zero_is_not_created() -> None:
    """A ledger row with no completion tokens or no cost adds 0 to those series: the series
    appears with the first amount that is not 0, as when the amount was only added when non-zero."""
    from prometheus_client import CollectorRegistry, Counter

    from gateway.telemetry import tallies

    registry = CollectorRegistry()
    c = Counter("t_zero", "z", ["k"], registry=registry)
    tallies._add((c, "z"), 0.0)
    tallies.fold()
    assert registry.get_sample_value("t_zero_total", {"k": "z"}) is None
    tallies._add((c, "z"), 2.0)
    tallies.fold()
    assert registry.get_sample_value("t_zero_total", {"k": "z"}) == 2.0


async def test_an_unhandled_error_is_counted_as_the_edge_s_500(tmp_path: Path, upstream: ScriptedUpstream,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The edge answers an exception no handler took with a 500; the request's metrics (timed by
    the same layer) count that 500."""
    monkeypatch.setenv("TIERGATE_ADMIN_KEY", ADMIN)
    async with app_with(tmp_path, upstream) as gw:
        async def boom() -> None:
            raise RuntimeError("not for the client")

        gw.app.add_api_route("/boom", boom)
        before = await scrape(gw.client)
        r = await gw.client.get("/boom")
        assert r.status_code == 500 and "not for the client" not in r.text
        after = await scrape(gw.client)
    grown = delta(after, before, "tiergate_http_requests_total", status="500")
    assert sum(grown.values()) == 1, grown
