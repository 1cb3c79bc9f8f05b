"""`tiergate bench ledger` end to end at a tiny size: it creates and drops its temp database,
serves through the real app in ABBA rounds of both phases (closed loop, then open loop at a share
of the open loop's ledger-off capacity, which it probes for first), seeds rows by COPY and checks the
spend summary from daily_spend against the raw ledger (the command raises if they disagree);
and the full-collection recorder it uses to report GC pauses."""

from __future__ import annotations

import gc
import re

import pytest
import sqlalchemy as sa

from gateway.bench.ledger_pg import FullCollections, run
from tests.conftest import PG_URL


def _bench_databases() -> int:
    engine = sa.create_engine(PG_URL)
    with engine.connect() as conn:
        n = conn.execute(sa.text("SELECT count(*) FROM pg_database WHERE datname LIKE 'tiergate_bench_%'")).scalar()
    engine.dispose()
    return int(n or 0)


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.postgres
def test_bench_ledger_pg_small(postgres_url: str) -> None:
    before = _bench_databases()
    lines = run(postgres_url, n=40, concurrency=4, upstream_ms=1, extra_rows_per_s=200, seed_rows=3000, rounds=2)
    text = "\n".join(lines)
    closed, *opened = text.split("\nopen loop at ")  # one block per offered load: 30% and 60%
    assert closed.count("\nclosed loop at saturation") == 1 and len(opened) == 2
    m = re.search(r"\nopen-loop capacity without a ledger: (\d+) requests/s, .* the closed loop's (\d+)/s", closed)
    assert m is not None, closed
    capacity = int(m.group(1))
    assert 0.2 * int(m.group(2)) - 1 <= capacity <= 1.25 ** 4 * int(m.group(2)) + 1
    probes = re.findall(r"\n  probe \d+ at \d+/s: offered (\d+)/s, achieved (\d+)/s \([\d.]+%\), median latency first "
                        r"quarter [\d.]+ ms, last quarter [\d.]+ ms \(bound [\d.]+ ms\): (keeps up|falls behind)",
                        closed)
    assert probes and any(v == "keeps up" for *_, v in probes)
    rates = []
    for block, share in zip(opened, ("30%", "60%"), strict=True):
        m = re.match(rf"(\d+) requests/s = {share} of the (\d+)/s open-loop capacity without a ledger", block)
        assert m is not None and 0 < int(m.group(1)) < int(m.group(2)) and int(m.group(2)) == capacity
        rates.append(int(m.group(1)))
        assert re.search(r"ledger on: +offered \d+/s, achieved \d+/s, p99", block)
    assert rates[0] < rates[1]
    for block, verdict in ((closed, "no target"), *((b, "target <= 1.10") for b in opened)):
        m = re.search(r"committed to PostgreSQL while serving .*: (\d+) in [\d.]+ s = (\d+) rows/s \(target >= 2000\): "
                      r"this process (\d+) rows/s, the other replica (\d+) rows/s \(during the ledger-off phases: "
                      r"(\d+) rows/s\)", block)
        assert m is not None and int(m.group(1)) > 0 and int(m.group(2)) > 0
        # the other replica writes all along; this process's rows of a phase this short may all
        # be committed after it (a batch every 200 ms), which the count leaves out
        assert int(m.group(3)) >= 0 and int(m.group(4)) > 0 and int(m.group(5)) > 0
        assert abs(int(m.group(3)) + int(m.group(4)) - int(m.group(2))) <= 1  # the total is the two summed
        assert re.search(rf"p99 ratio on/off: \d+\.\d+ \(median of the rounds; {verdict}", block)
        # two rounds are too few for a 95% interval of the median: the run says so instead of a verdict
        assert re.search(r"; 50% interval (of the median from the rounds' order statistics )?\d+\.\d+\.\.\d+\.\d+", block)
        if verdict != "no target":
            assert "too few rounds for a 95% interval: not settled" in block
        per_round = re.search(r"p99 ratio on/off per round: ([\d. ]+); all rounds pooled: \d+\.\d+", block)
        assert per_round is not None and len(per_round.group(1).split()) == 2
        assert re.search(r"full GC pauses while timed: ledger off \d+ \(max [\d.]+ ms\), ledger on \d+", block)
        assert re.search(r"all garbage collections while timed, ledger on:  gen0 \d+, \d+ ms in all, max [\d.]+ ms; "
                         r"gen1 \d+, .*; gen2 \d+, ", block)
        phases = re.findall(r"round (\d) ledger (off|on): +(?:offered \d+/s, )?achieved \d+/s, p99 +[\d.]+ ms, [\d.]+ ms without its longest stall: "
                            r"\d+ ms at [\d.]+ s \(\d+ in flight\); loop lag max \d+ ms at [\d.]+ s \(loop thread "
                            r"meanwhile: \d+ ms on a CPU, \d+ ms waiting for one\); phase [\d.]+ s", block)
        assert phases == [("1", "off"), ("1", "on"), ("2", "on"), ("2", "off")]  # ABBA, one line per phase
        assert re.search(r"loop thread waiting for a CPU, max share of a phase: ledger off \d+%, ledger on \d+%",
                         block)
        assert re.search(r"loop thread CPU per request \(median of the phases\): ledger off \d+ us, on \d+ us; on/off "
                         r"median of the rounds \d+\.\d+ \[\d+\.\d+\.\.\d+\.\d+\]; the loop thread on a CPU \d+% / \d+% of the "
                         r"phase", block)
    # the ledger's calls timed in a phase of their own, at the first open-loop rate
    m = re.search(r"\nwhere the ledger's loop-thread time goes: one more ledger-on phase \(20 requests, open loop at "
                  rf"{rates[0]}/s\), not in the ratios above\n  the ledger's calls on the event loop .*: begin x1\.00 p50 "
                  r"[\d.]+ us mean [\d.]+ us; record x1\.00 .*; record_request x1\.00 .*; wait_durable x1\.00 .*\n"
                  r"  per request (\d+) us of the loop thread's (\d+) us", text)
    assert m is not None, text
    assert 0 < int(m.group(1)) < int(m.group(2))
    assert "3000 ledger rows seeded" in text and "spend summary (daily_spend" in text
    assert _bench_databases() == before  # the temp database was dropped


def test_full_collections_records_generation_2_pauses_only_while_entered() -> None:
    pauses = FullCollections()
    gc.collect(0)
    with pauses:
        gc.collect(0)
        gc.collect(1)
        assert pauses.pauses_ms == []
        gc.collect()
        assert len(pauses.pauses_ms) == 1 and pauses.pauses_ms[0] >= 0
    gc.collect()
    assert len(pauses.pauses_ms) == 1
