"""Engines and session factories. SQLite gets WAL, foreign keys, a busy timeout and
``synchronous=FULL`` (the ledger deletes journal segments only after a commit, so that commit
must survive power loss). Relative SQLite paths resolve against the config file's directory
and their parent folder is created. Must not import gateway modules other than settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from gateway.settings import Settings


def resolve_url(url: str | URL, base_dir: str | Path | None = None) -> URL:
    """Make a relative SQLite file path absolute (relative to ``base_dir``); other URLs unchanged."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:" \
            and not u.database.startswith("file:"):
        path = Path(u.database)
        if not path.is_absolute():
            path = Path(base_dir or ".").resolve() / path
        u = u.set(database=str(path))
    return u


def database_url(settings: Settings) -> URL:
    """The database URL from the environment / config, resolved against the config dir."""
    return resolve_url(settings.database.resolved_url(), settings.base_dir)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=10000")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
    finally:
        cur.close()


def make_engine(url: str | URL, *, base_dir: str | Path | None = None, **kwargs: Any) -> Engine:
    """Create an Engine. In-memory SQLite uses one shared connection (usable from the ledger's
    threads); file SQLite gets its parent directory created."""
    u = resolve_url(url, base_dir)
    if u.get_backend_name() != "sqlite":
        kwargs.setdefault("pool_pre_ping", True)
        return sa.create_engine(u, **kwargs)
    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("check_same_thread", False)
    if not u.database or u.database == ":memory:":
        kwargs.setdefault("poolclass", StaticPool)
    else:
        Path(u.database).parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(u, connect_args=connect_args, **kwargs)
    sa.event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def engine_from_settings(settings: Settings, **kwargs: Any) -> Engine:
    return make_engine(database_url(settings), **kwargs)
