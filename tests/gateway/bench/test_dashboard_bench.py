"""`tiergate bench dashboard`, run small: it seeds a temporary PostgreSQL database, times every
console page against the no-database baseline, prints each page's p50/p99 and ratio, checks the
overview's rollups against daily_spend and times its spend read against the aggregate it
replaced, and drops the database."""

from __future__ import annotations

import os
import re

import pytest
import sqlalchemy as sa

from gateway.bench.dashboard import run


def _database_exists(url: str, name: str) -> bool:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        n = conn.execute(sa.text("SELECT count(*) FROM pg_database WHERE datname = :n"), {"n": name}).scalar()
    engine.dispose()
    return bool(n)


@pytest.mark.slow
@pytest.mark.postgres
def test_bench_dashboard_small(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERGATE_ADMIN_KEY", raising=False)
    lines = run(postgres_url, tenants=30, rows=3000, repeats=3)
    text = "\n".join(lines)
    assert "30 tenants, 3000 requests" in text
    for page in ("overview (HTML)", "overview (JSON)", "tenant page (HTML)", "tenant (JSON)", "tenant keys (JSON)",
                 "audit log (JSON)"):
        assert re.search(re.escape(page) + r"\s+p50\s+[\d.]+ ms\s+p99\s+[\d.]+ ms\s+p50 x[\d.]+ of the baseline", text), page
    assert re.search(r"worst console page p99: [\d.]+ ms", text)
    assert re.search(r"full garbage collections while timed: \d+, longest [\d.]+ ms", text)
    assert re.search(r"rollups p50 [\d.]+ ms .* daily_spend aggregate .* p50 ratio aggregate/rollups x[\d.]+", text)
    assert re.search(r"equal daily_spend's sums exactly for \d+ tenants", text)
    dropped = re.search(r"database (tiergate_bench_[0-9a-f]+) dropped", text)  # by name: other benches may share the server
    assert dropped and not _database_exists(postgres_url, dropped.group(1))
    assert "TIERGATE_ADMIN_KEY" not in os.environ  # restored
