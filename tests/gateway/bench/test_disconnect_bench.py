"""Smoke test for `tiergate bench disconnect` (so the bench does not rot): a few streams against
`tiergate serve` and against the stock-protocol server, cut by their clients; every cut call is
stopped upstream and billed ``cancelled``, and the report prints both ratios. No timing is
asserted."""

from __future__ import annotations

import re

import pytest

from gateway.bench.disconnect import DisconnectArgs, run_disconnect_bench


@pytest.mark.integration
@pytest.mark.process
@pytest.mark.slow
def test_bench_disconnect_stops_and_bills_every_cut_stream() -> None:
    report = run_disconnect_bench(DisconnectArgs(streams=4, baseline_streams=2, seconds=2.0, chunk_ms=50.0,
                                                 rounds=1))
    lines = report.splitlines()
    phases = [x for x in lines if "disconnects, upstream stopped after" in x]
    assert len(phases) == 3, report
    for phase in phases:
        m = re.search(r": (\d+) disconnects, .*; 0 never stopped, 0 ran to their end, 0 failed to open", phase)
        assert m is not None and int(m.group(1)) > 0, report
    for ledger in (x for x in lines if "cut calls billed 'cancelled'" in x):
        m = re.search(r"(\d+)/(\d+) cut calls billed 'cancelled'", ledger)
        assert m is not None and m.group(1) == m.group(2) != "0", report
    assert re.search(r"hang-up hook vs receive\(\) at 4 streams: p50 x\d+\.\d\d, p99 x\d+\.\d\d", report), report
