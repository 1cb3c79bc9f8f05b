"""`tiergate bench ledger` end to end at a tiny size: it creates and drops its temp database,
serves through the real app in both phases, seeds rows by COPY and checks the spend summary
from daily_spend against the raw ledger (the command raises if they disagree)."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa

from gateway.cli.bench_ledger_pg import run
from tests.conftest import PG_URL

pytestmark = pytest.mark.postgres


def _bench_databases() -> int:
    engine = sa.create_engine(PG_URL)
    with engine.connect() as conn:
        n = conn.execute(sa.text("SELECT count(*) FROM pg_database WHERE datname LIKE 'tiergate_bench_%'")).scalar()
    engine.dispose()
    return int(n or 0)


def test_bench_ledger_pg_small(postgres_url: str) -> None:
    before = _bench_databases()
    lines = run(postgres_url, n=40, concurrency=4, upstream_ms=1, extra_rows_per_s=200, seed_rows=3000)
    text = "\n".join(lines)
    m = re.search(r"committed to PostgreSQL while serving .*: (\d+) in [\d.]+ s = (\d+) rows/s", text)
    assert m is not None and int(m.group(1)) > 0 and int(m.group(2)) > 0
    assert re.search(r"p99 ratio on/off: \d+\.\d+", text)
    assert "3000 ledger rows seeded" in text and "spend summary (daily_spend" in text
    assert _bench_databases() == before  # the temp database was dropped
