"""KeyStore: hashed keys, cached lookups, revocation within the TTL, hostile headers refused."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.auth import KeyStore, Principal, generate_key, hash_key, parse_bearer
from gateway.db import queries
from gateway.db.models import Base
from gateway.db.session import make_engine, make_session_factory
from gateway.errors import AuthenticationFailed, ServiceUnavailable


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    engine = make_engine(f"sqlite:///{tmp_path}/a.db")
    Base.metadata.create_all(engine)
    factory = make_session_factory(engine)
    raw = generate_key()
    with factory() as s, s.begin():
        tenant = queries.create_tenant(s, "acme", allow_prompt_storage=True)
        key = queries.add_api_key(s, tenant.id, raw, hash_key(raw))
    yield factory, raw, tenant.id, key.id
    engine.dispose()


def test_hash_and_generate() -> None:
    a, b = generate_key(), generate_key()
    assert a != b and a.startswith("tg-") and len(a) > 40
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


async def test_valid_key_resolves_to_principal(setup) -> None:  # type: ignore[no-untyped-def]
    factory, raw, tenant_id, key_id = setup
    store = KeyStore(factory)
    p = await store.authenticate(f"Bearer {raw}")
    assert p == Principal(tenant_id=tenant_id, key_id=key_id, key_prefix=raw[:12], allow_prompt_storage=True)
    assert await store.authenticate(f"bearer  {raw}") == p


async def test_hot_path_is_cached(setup) -> None:  # type: ignore[no-untyped-def]
    factory, raw, *_ = setup
    store = KeyStore(factory, clock=FakeClock())
    for _ in range(50):
        await store.authenticate(f"Bearer {raw}")
    assert store.db_lookups == 1


async def test_concurrent_misses_share_one_lookup(setup) -> None:  # type: ignore[no-untyped-def]
    factory, raw, *_ = setup
    store = KeyStore(factory)
    results = await asyncio.gather(*(store.authenticate(f"Bearer {raw}") for _ in range(20)))
    assert len(set(results)) == 1 and store.db_lookups == 1


async def test_revoked_key_refused_after_ttl(setup) -> None:  # type: ignore[no-untyped-def]
    factory, raw, _, key_id = setup
    clock = FakeClock()
    store = KeyStore(factory, ttl_s=30, clock=clock)
    await store.authenticate(f"Bearer {raw}")
    with factory() as s, s.begin():
        queries.revoke_api_key(s, key_id)
    clock.now += 29
    await store.authenticate(f"Bearer {raw}")  # still cached: accepted inside the TTL
    clock.now += 2
    with pytest.raises(AuthenticationFailed):
        await store.authenticate(f"Bearer {raw}")


async def test_invalidate_refuses_immediately(setup) -> None:  # type: ignore[no-untyped-def]
    factory, raw, _, key_id = setup
    store = KeyStore(factory, clock=FakeClock())
    await store.authenticate(f"Bearer {raw}")
    with factory() as s, s.begin():
        queries.revoke_api_key(s, key_id)
    store.invalidate(raw)
    with pytest.raises(AuthenticationFailed):
        await store.authenticate(f"Bearer {raw}")


async def test_unknown_keys_are_negatively_cached_and_bounded(setup) -> None:  # type: ignore[no-untyped-def]
    factory, raw, *_ = setup
    store = KeyStore(factory, max_entries=8, clock=FakeClock())
    await store.authenticate(f"Bearer {raw}")
    for _ in range(3):
        with pytest.raises(AuthenticationFailed):
            await store.authenticate("Bearer tg-unknown-key-0")
    assert store.db_lookups == 2
    for i in range(100):  # a spray of random keys cannot evict the valid one
        with pytest.raises(AuthenticationFailed):
            await store.authenticate(f"Bearer tg-spray-{i:04d}")
    before = store.db_lookups
    await store.authenticate(f"Bearer {raw}")
    assert store.db_lookups == before
    assert len(store._unknown._data) <= 8


HOSTILE_HEADERS = [
    None, "", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Token abc", "Bearer ' OR '1'='1",
    "Bearer x' OR 1=1 --", "Bearer '; DROP TABLE api_keys; --", "Bearer tg-a\x00b", "Bearer tg-ab\r\nX: y",
    "Bearer " + "a" * 5000, "Bearer tg-\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9", "Bearer a b", "Bearer %s%s%s%s",
]


@pytest.mark.parametrize("header", HOSTILE_HEADERS)
async def test_hostile_headers_fail_cleanly(setup, header: str | None) -> None:  # type: ignore[no-untyped-def]
    factory, *_ = setup
    store = KeyStore(factory)
    with pytest.raises(AuthenticationFailed) as info:
        await store.authenticate(header)
    assert info.value.status == 401 and info.value.body()["error"]["code"] == "invalid_api_key"
    if header and len(header) > 12:
        assert header[7:] not in info.value.message
    with factory() as s:
        assert s.scalar(sa.text("SELECT count(*) FROM api_keys")) == 1


async def test_injection_shaped_but_well_formed_key_is_just_unknown(setup) -> None:  # type: ignore[no-untyped-def]
    factory, *_ = setup
    store = KeyStore(factory)
    with pytest.raises(AuthenticationFailed, match="Invalid API key"):
        await store.authenticate("Bearer tg-1--OR--1.1")
    assert store.db_lookups == 1


def test_parse_bearer_message_never_contains_the_key() -> None:
    secret = "tg-" + "s" * 300
    with pytest.raises(AuthenticationFailed) as info:
        parse_bearer(f"Bearer {secret}")
    assert "sss" not in info.value.message


async def test_database_errors_are_not_authentication_failures(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/empty.db")  # no tables
    store = KeyStore(make_session_factory(engine))
    with pytest.raises(ServiceUnavailable) as info:  # a 503 to retry, never a 401 (nor a 500)
        await store.authenticate("Bearer tg-whatever-123")
    assert isinstance(info.value.__cause__, sa.exc.OperationalError)
    engine.dispose()


async def test_a_database_outage_serves_keys_from_the_stale_cache_within_its_bound(setup) -> None:  # type: ignore[no-untyped-def]
    factory, raw, tenant_id, _ = setup
    clock = FakeClock()
    store = KeyStore(factory, ttl_s=1.0, clock=clock, stale_s=60.0)
    assert (await store.authenticate(f"Bearer {raw}")).tenant_id == tenant_id
    with factory() as s, s.begin():
        s.execute(sa.text("DROP TABLE api_keys"))  # every lookup now fails in the database
    clock.now += 30  # expired, within the stale bound
    assert (await store.authenticate(f"Bearer {raw}")).tenant_id == tenant_id
    with pytest.raises(ServiceUnavailable):  # a key never seen: it cannot be checked
        await store.authenticate(f"Bearer {generate_key()}")
    clock.now += 31  # past the stale bound
    with pytest.raises(ServiceUnavailable):
        await store.authenticate(f"Bearer {raw}")


class GatedSessions:
    """A session factory whose sessions open only while ``gate`` is set (lookups run in threads)."""

    def __init__(self, factory) -> None:  # type: ignore[no-untyped-def]
        self.factory = factory
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self):  # type: ignore[no-untyped-def]
        assert self.gate.wait(30), "the test never opened the gate"
        return self.factory()


async def _answered_without_the_database(store: KeyStore, raw: str) -> bool:
    """Whether authenticate answers while every database lookup is held at the gate."""
    task = asyncio.ensure_future(store.authenticate(f"Bearer {raw}"))
    for _ in range(5):
        await asyncio.sleep(0)
    return task.done()


async def _refreshes_done(store: KeyStore) -> None:
    """Wait for the background lookups the store started (none, in a store that starts none)."""
    await asyncio.gather(*getattr(store, "_refreshing", {}).values(), return_exceptions=True)


async def test_a_key_in_steady_use_is_refreshed_in_the_background_and_never_waits(setup) -> None:  # type: ignore[no-untyped-def]
    factory, raw, tenant_id, _ = setup
    sessions, clock = GatedSessions(factory), FakeClock()
    store = KeyStore(sessions, ttl_s=1.0, clock=clock)  # type: ignore[arg-type]
    await store.authenticate(f"Bearer {raw}")  # cached until 1001.0
    sessions.gate.clear()
    clock.now += 0.6  # past half its TTL: answered from the cache, looked up again meanwhile
    assert await _answered_without_the_database(store, raw)
    sessions.gate.set()
    await _refreshes_done(store)
    assert store.db_lookups == 2
    sessions.gate.clear()
    clock.now = 1001.2  # the first lookup's entry has expired; the refreshed one (until 1001.6) answers
    assert await _answered_without_the_database(store, raw)
    sessions.gate.set()
    await _refreshes_done(store)
    assert (await store.authenticate(f"Bearer {raw}")).tenant_id == tenant_id


async def test_a_background_refresh_that_finds_the_key_revoked_refuses_it_at_once(setup) -> None:  # type: ignore[no-untyped-def]
    factory, raw, _, key_id = setup
    clock = FakeClock()
    store = KeyStore(factory, ttl_s=30, clock=clock)
    await store.authenticate(f"Bearer {raw}")
    with factory() as s, s.begin():
        queries.revoke_api_key(s, key_id)
    clock.now += 20  # inside the TTL: still accepted, and looked up again in the background
    await store.authenticate(f"Bearer {raw}")
    await _refreshes_done(store)
    with pytest.raises(AuthenticationFailed):  # refused before the 30 s TTL ran out
        await store.authenticate(f"Bearer {raw}")


async def test_a_failed_background_refresh_leaves_the_cached_key_until_it_expires(setup) -> None:  # type: ignore[no-untyped-def]
    factory, raw, tenant_id, _ = setup
    clock = FakeClock()
    store = KeyStore(factory, ttl_s=1.0, clock=clock, stale_s=0.0)
    await store.authenticate(f"Bearer {raw}")
    with factory() as s, s.begin():
        s.execute(sa.text("DROP TABLE api_keys"))
    clock.now += 0.6
    assert (await store.authenticate(f"Bearer {raw}")).tenant_id == tenant_id
    await _refreshes_done(store)
    assert (await store.authenticate(f"Bearer {raw}")).tenant_id == tenant_id  # the refresh failed: still cached
    clock.now += 0.5  # expired: the lookup in the request's path fails, no stale allowance
    with pytest.raises(ServiceUnavailable):
        await store.authenticate(f"Bearer {raw}")
