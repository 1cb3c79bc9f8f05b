"""Alembic: upgrade → downgrade → upgrade on SQLite and PostgreSQL, and a drift check that fails
when the SQLAlchemy models and the migrations disagree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from gateway.db import migrate
from gateway.db.models import Base
from gateway.db.session import make_engine

CORE_TABLES = {"tenants", "api_keys", "requests", "ledger_entries", "daily_spend", "feedback"}


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _up_down_up(url: str) -> None:
    migrate.upgrade(url)
    assert _tables(url) >= CORE_TABLES
    assert migrate.current_revisions(url) != ()
    migrate.downgrade(url, "base")
    assert _tables(url) == set()
    assert migrate.current_revisions(url) == ()
    migrate.upgrade(url)
    assert _tables(url) >= CORE_TABLES


def _drift(url: str) -> list[object]:
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        engine.dispose()


def test_sqlite_upgrade_downgrade_upgrade(tmp_path: Path) -> None:
    _up_down_up(f"sqlite:///{tmp_path}/m.db")


@pytest.mark.postgres
def test_postgres_upgrade_downgrade_upgrade(postgres_url: str) -> None:
    _up_down_up(postgres_url)


def test_sqlite_models_match_migrations(tmp_path: Path) -> None:
    assert _drift(f"sqlite:///{tmp_path}/d.db") == []


@pytest.mark.postgres
def test_postgres_models_match_migrations(postgres_url: str) -> None:
    assert _drift(postgres_url) == []


def test_drift_check_detects_a_model_change(tmp_path: Path) -> None:
    """The drift check is live: a column added to the models but not migrated is reported."""
    url = f"sqlite:///{tmp_path}/x.db"
    migrate.upgrade(url)
    md = sa.MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(md)
    sa.Table("tenants", md, sa.Column("surprise", sa.Integer), extend_existing=True)
    engine = make_engine(url)
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), md)
    engine.dispose()
    assert any(d[0] == "add_column" and d[3].name == "surprise" for d in diffs)  # type: ignore[index]


def test_head_is_initial_or_descends_from_it(tmp_path: Path) -> None:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrate.alembic_config(f"sqlite:///{tmp_path}/h.db"))
    assert "0001_initial" in {r.revision for r in script.walk_revisions()}
    assert script.get_revision("0001_initial").down_revision is None


_TABLES = """
import gateway.db.models as m
print(sorted(m.Base.metadata.tables))
print(sorted(ix.name for t in m.Base.metadata.tables.values() for ix in t.indexes))
print(sorted({mapper.class_.__module__ for mapper in m.Base.registry.mappers}))
"""


def _tables_after(imports: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", imports + _TABLES], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


@pytest.mark.process
@pytest.mark.slow
def test_gateway_db_models_alone_declares_every_table() -> None:
    """Importing ``gateway.db.models`` registers every table and index (nothing is added as a side
    effect of importing another package), and every mapped class is declared under it."""
    alone = _tables_after("")
    everything = _tables_after("import gateway.app, gateway.jobs.store, gateway.worker, gateway.budgets\n")
    assert alone == everything
    assert "ix_ledger_entries_key_created" in alone[1] and "budget_reservations" in alone[0]
    modules = alone[2].strip("[]").replace("'", "").split(", ")
    assert all(name.startswith("gateway.db.models.") for name in modules), modules
