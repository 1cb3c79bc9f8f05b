"""API-key authentication: keys are stored as SHA-256 hex digests plus a short visible
prefix; the raw key is shown once at creation and never stored or logged.

``KeyStore.authenticate(header)`` parses ``Authorization: Bearer <key>``, refuses anything
malformed with ``AuthenticationFailed`` (the message never echoes the key), and resolves
the hash through a bounded TTL cache, so the hot path does not query the database per
request. A revoked key is refused at the latest ``ttl_s`` after its revocation commits, by
every process (an entry expires ``ttl_s`` after its lookup *started*, so a lookup that raced the
revocation cannot extend it), and at once in the process that calls ``invalidate``. Database lookups run off the event loop with bound
parameters; concurrent misses for the same key share one lookup. Database errors propagate
(they are not authentication failures). Imports db and errors only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from gateway.db.queries import ActiveKey, find_active_key
from gateway.errors import AuthenticationFailed, ServiceUnavailable
from gateway.routing import NO_PREFS, RoutingPrefs

log = logging.getLogger(__name__)

KEY_PREFIX = "tg-"
# A valid key used when less than this share of its cache entry's TTL is left is refreshed in the
# background (KeyStore).
REFRESH_AHEAD = 0.5
# Keys we issue are "tg-" + 43 urlsafe chars; accept any sane token shape, refuse the rest unseen.
_KEY_RE = re.compile(r"[A-Za-z0-9_\-\.]{8,256}")
_BEARER_RE = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] +(\S+) *")


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    tenant_id: str
    key_id: str
    key_prefix: str
    allow_prompt_storage: bool
    routing: RoutingPrefs = NO_PREFS  # the tenant's exploration share and threshold target (None: the config's)


def parse_bearer(header: str | None) -> str:
    """The key in an Authorization header; AuthenticationFailed if absent or malformed."""
    if not header:
        raise AuthenticationFailed("Missing API key. Send 'Authorization: Bearer <key>'.")
    m = _BEARER_RE.fullmatch(header) if len(header) <= 300 else None
    if m is None or not _KEY_RE.fullmatch(m.group(1)):
        raise AuthenticationFailed("Malformed Authorization header. Send 'Authorization: Bearer <key>'.")
    return m.group(1)


class _TTLCache:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._data: OrderedDict[str, tuple[float, Principal | None]] = OrderedDict()

    def get(self, key: str, now: float) -> tuple[bool, Principal | None]:
        hit = self._data.get(key)
        if hit is None or hit[0] <= now:
            return False, None
        self._data.move_to_end(key)
        return True, hit[1]

    def put(self, key: str, value: Principal | None, expires: float) -> None:
        self._data[key] = (expires, value)
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)

    def expires(self, key: str) -> float | None:
        hit = self._data.get(key)
        return None if hit is None else hit[0]

    def stale(self, key: str, now: float, max_stale_s: float) -> tuple[bool, Principal | None]:
        """An entry that expired less than ``max_stale_s`` ago (the database is unreachable)."""
        hit = self._data.get(key)
        if hit is None or hit[0] + max_stale_s <= now:
            return False, None
        return True, hit[1]

    def pop(self, key: str) -> None:
        self._data.pop(key, None)

    def clear(self) -> None:
        self._data.clear()


class KeyStore:
    """Resolves API keys to principals with a bounded TTL cache in front of the database.

    Valid and unknown keys are cached separately (an attacker spraying random keys cannot
    evict valid ones); unknown keys for ``negative_ttl_s``. While the database is unreachable
    a key looked up less than ``stale_s`` ago is still accepted (nothing can be revoked meanwhile:
    revocations go through the database); any other key gets a 503.

    A valid key used in the last ``REFRESH_AHEAD`` of its entry's life is looked up again in the
    background while the cached principal answers, so a key in steady use never expires: without
    that, every ``ttl_s`` all of a key's arriving requests waited on one database round trip
    (``tiergate bench ledger``: 10-170 ms for 20-33 of a phase's 500 requests, the lookup's thread
    contending for the GIL with a busy loop). The bound on revocation is unchanged (an entry
    still expires ``ttl_s`` after its lookup started), and a refresh that finds the key revoked
    drops it at once."""

    def __init__(self, session_factory: sessionmaker[Session], ttl_s: float = 1.0, *,
                 negative_ttl_s: float = 5.0, max_entries: int = 10_000,
                 clock: Callable[[], float] = time.monotonic, stale_s: float = 300.0) -> None:
        self._session_factory = session_factory
        self.ttl_s = ttl_s
        self.stale_s = stale_s
        self.negative_ttl_s = negative_ttl_s
        self._clock = clock
        self._valid = _TTLCache(max_entries)
        self._unknown = _TTLCache(max_entries)
        self._inflight: dict[str, asyncio.Future[Principal | None]] = {}
        self._refreshing: dict[str, asyncio.Task[Principal | None]] = {}
        self.db_lookups = 0

    async def authenticate(self, authorization_header: str | None) -> Principal:
        raw = parse_bearer(authorization_header)
        digest = hash_key(raw)
        now = self._clock()
        hit, principal = self._valid.get(digest, now)
        if hit:
            expires = self._valid.expires(digest)
            if expires is not None and expires - now < self.ttl_s * REFRESH_AHEAD:
                self._refresh(digest)
            return self._accept(principal)
        hit, principal = self._unknown.get(digest, now)
        if hit:
            return self._accept(principal)
        try:
            return self._accept(await self._lookup(digest))
        except DBAPIError as exc:  # the database is unreachable: serve from the cache if we can
            for cache in (self._valid, self._unknown):
                hit, principal = cache.stale(digest, self._clock(), self.stale_s)
                if hit:
                    return self._accept(principal)
            raise ServiceUnavailable("API keys cannot be checked right now (the database is unreachable). "
                                     "Retry later.", retry_after_s=5) from exc

    @staticmethod
    def _accept(principal: Principal | None) -> Principal:
        if principal is None:
            raise AuthenticationFailed("Invalid API key.")
        return principal

    def _refresh(self, digest: str) -> None:
        """Look ``digest`` up again in the background (once at a time; errors are left to the
        lookup that follows the entry's expiry, which falls back on the stale cache)."""
        if digest in self._refreshing or digest in self._inflight:
            return
        task = asyncio.ensure_future(self._lookup(digest))
        self._refreshing[digest] = task

        def done(t: asyncio.Task[Principal | None]) -> None:
            self._refreshing.pop(digest, None)
            if not t.cancelled() and t.exception() is not None:
                log.debug("background key refresh failed: %s", type(t.exception()).__name__)

        task.add_done_callback(done)

    async def _lookup(self, digest: str) -> Principal | None:
        pending = self._inflight.get(digest)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[Principal | None] = asyncio.get_running_loop().create_future()
        self._inflight[digest] = fut
        started = self._clock()
        try:
            principal = await asyncio.to_thread(self._query, digest)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                fut.cancel()
            else:
                fut.set_exception(exc)
                fut.exception()  # mark retrieved: concurrent waiters (if any) re-raise it themselves
            raise
        finally:
            self._inflight.pop(digest, None)
        if principal is None:
            self._valid.pop(digest)  # revoked since it was cached: a refresh drops it at once
            self._unknown.put(digest, None, started + self.negative_ttl_s)
        else:
            self._valid.put(digest, principal, started + self.ttl_s)
        fut.set_result(principal)
        return principal

    def _query(self, digest: str) -> Principal | None:
        self.db_lookups += 1
        with self._session_factory() as session:
            key: ActiveKey | None = find_active_key(session, digest)
        if key is None or not hmac.compare_digest(key.key_hash, digest):
            return None
        return Principal(tenant_id=key.tenant_id, key_id=key.key_id, key_prefix=key.key_prefix,
                         allow_prompt_storage=key.allow_prompt_storage,
                         routing=RoutingPrefs(key.routing_exploration, key.routing_target_quality,
                                              key.routing_target_cost))

    def invalidate(self, raw_key_or_hash: str) -> None:
        """Forget a key now (e.g. right after revoking it in this process)."""
        for digest in {raw_key_or_hash, hash_key(raw_key_or_hash)}:
            self._valid.pop(digest)
            self._unknown.pop(digest)

    def clear(self) -> None:
        self._valid.clear()
        self._unknown.clear()
