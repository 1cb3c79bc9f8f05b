"""`tiergate bench obs-instructions`' parts that run without valgrind: the dump total and the report."""

from __future__ import annotations

from pathlib import Path

from gateway.bench.obs_instructions import InstructionArgs, Run, dump_total, report


def test_dump_total_reads_the_totals_line(tmp_path: Path) -> None:
    dump = tmp_path / "callgrind.out.1"
    dump.write_bytes(b"version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 0\nfn=main\n1 5\ntotals: 1020946691\n")
    assert dump_total(dump) == 1020946691


def test_report_puts_each_variant_against_off_with_the_runs_spread() -> None:
    runs = [Run("off", 3_000_000, 1), Run("off", 3_060_000, 1), Run("metrics", 3_090_000, 1),
            Run("metrics", 3_120_000, 1), Run("metrics+tracing@1.0", 3_300_000, 1),
            Run("metrics+tracing@1.0", 3_330_000, 1)]
    lines = report(runs, InstructionArgs(requests=1, runs=2))
    text = "\n".join(lines)
    assert "metrics: +2.5% -> met" in text and "metrics+tracing@1.0: +9.4% -> NOT met" in text
    assert "(off: 2.0%)" in text
