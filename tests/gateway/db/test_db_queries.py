"""Engines, SQLite pragmas and the tenant/key queries, including hostile strings as names and ids."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.auth import generate_key, hash_key
from gateway.db import queries
from gateway.db.models import Base
from gateway.db.session import make_engine, make_session_factory, resolve_url

HOSTILE = ["' OR '1'='1", "x'; DROP TABLE tenants; --", '"); DELETE FROM api_keys; --', "nul\\x00 \\0",
           "%s %(x)s ?", "ñ😀" * 20]


@pytest.fixture
def factory(tmp_path: Path):  # type: ignore[no-untyped-def]
    engine = make_engine(f"sqlite:///{tmp_path}/q.db")
    Base.metadata.create_all(engine)
    yield make_session_factory(engine)
    engine.dispose()


def test_relative_sqlite_path_resolves_against_base_dir(tmp_path: Path) -> None:
    url = resolve_url("sqlite:///var/x.db", tmp_path)
    assert url.database == str(tmp_path / "var" / "x.db")
    assert resolve_url("sqlite:////abs/y.db", tmp_path).database == "/abs/y.db"
    assert resolve_url("sqlite://", tmp_path).database in (None, "")
    assert resolve_url("postgresql+psycopg://u@h/db", tmp_path).database == "db"


def test_file_sqlite_gets_wal_foreign_keys_and_parent_dir(tmp_path: Path) -> None:
    engine = make_engine("sqlite:///nested/dir/t.db", base_dir=tmp_path)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    assert (tmp_path / "nested" / "dir" / "t.db").exists()
    engine.dispose()


def test_memory_sqlite_is_shared_across_threads() -> None:
    engine = make_engine("sqlite://")
    Base.metadata.create_all(engine)
    factory = make_session_factory(engine)

    def add() -> None:
        with factory() as s, s.begin():
            queries.create_tenant(s, "from-thread")

    t = threading.Thread(target=add)
    t.start()
    t.join()
    with factory() as s:
        assert [x.name for x in queries.list_tenants(s)] == ["from-thread"]


def test_tenant_and_key_lifecycle(factory) -> None:  # type: ignore[no-untyped-def]
    raw = generate_key()
    with factory() as s, s.begin():
        tenant = queries.create_tenant(s, "acme")
        key = queries.add_api_key(s, tenant.id, raw, hash_key(raw), "ci")
    assert key.prefix == raw[:12] and raw.startswith("tg-")
    with factory() as s:
        assert queries.find_tenant(s, "acme").id == tenant.id
        assert queries.find_tenant(s, tenant.id).name == "acme"
        active = queries.find_active_key(s, hash_key(raw))
        assert active is not None and active.tenant_id == tenant.id and active.key_id == key.id
        stored = s.execute(sa.text("SELECT key_hash, prefix FROM api_keys")).all()
    assert stored == [(hash_key(raw), raw[:12])]  # the raw key itself is stored nowhere
    with factory() as s, s.begin():
        queries.revoke_api_key(s, key.id)
    with factory() as s:
        assert queries.find_active_key(s, hash_key(raw)) is None
        assert queries.list_api_keys(s, tenant.id)[0].revoked_at is not None


def test_revoke_by_ambiguous_prefix_is_refused(factory) -> None:  # type: ignore[no-untyped-def]
    with factory() as s, s.begin():
        t = queries.create_tenant(s, "t")
        queries.add_api_key(s, t.id, "tg-samesamesame-1", hash_key("a"))
        queries.add_api_key(s, t.id, "tg-samesamesame-2", hash_key("b"))
    with factory() as s, pytest.raises(queries.RecordNotFound, match="matches 2 keys"):
        queries.revoke_api_key(s, "tg-samesames")


@pytest.mark.parametrize("evil", HOSTILE)
def test_hostile_strings_are_plain_data(factory, evil: str) -> None:  # type: ignore[no-untyped-def]
    with factory() as s, s.begin():
        t = queries.create_tenant(s, evil)
        queries.add_api_key(s, t.id, "tg-" + "a" * 40, hash_key(evil), name=evil)
    with factory() as s:
        assert queries.find_tenant(s, evil).name == evil
        with pytest.raises(queries.RecordNotFound):
            queries.find_tenant(s, evil + "'--")
        with pytest.raises(queries.RecordNotFound):
            queries.revoke_api_key(s, evil)
        assert queries.find_active_key(s, evil) is None
        assert s.scalar(sa.text("SELECT count(*) FROM tenants")) == 1
        assert s.scalar(sa.text("SELECT count(*) FROM api_keys")) == 1
