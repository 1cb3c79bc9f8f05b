"""`tiergate bench ledger-sqlite` runs end to end on a tiny size and prints its ratios (no timing asserted)."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from gateway.cli.bench import ledger_sqlite_bench as ledger

pytestmark = pytest.mark.slow


def test_bench_ledger_prints_ratios_against_the_naive_baseline() -> None:
    app = typer.Typer()
    app.command("ledger-sqlite")(ledger)
    app.command("unused")(lambda: None)
    result = CliRunner().invoke(app, ["ledger-sqlite", "--n", "40", "--concurrency", "4"])
    assert result.exit_code == 0, result.output
    assert "(baseline)" in result.output
    assert len(re.findall(r"rows/s\s+x\d+\.\d", result.output)) == 3
    assert re.search(r"p50 \d+\.\d\d ms, p99 \d+\.\d\d ms", result.output)
