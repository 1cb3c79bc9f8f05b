"""Fixtures of the ledger tests: an empty SQLite database with every table, for a Ledger or the
applier to write to."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from gateway.db.models import Base
from gateway.db.session import make_engine, make_session_factory


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """A session factory on ``tmp_path/l.db`` with every table created (no migrations)."""
    yield from _tables(f"sqlite:///{tmp_path}/l.db")


def _tables(url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(url)
    Base.metadata.create_all(engine)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """``db`` on SQLite, then on a fresh PostgreSQL database (where the applier's bulk
    statements, gateway.ledger.applier_pg, run instead of the generic ones)."""
    yield from _tables(f"sqlite:///{tmp_path}/l.db" if request.param == "sqlite"
                       else request.getfixturevalue("postgres_url"))
