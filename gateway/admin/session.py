"""Admin session tokens: ``<expires>.<nonce>.<hmac>`` signed with a key derived from the
admin key, so rotating the admin key logs every session out. Pure: no web framework, no
database; the clock is passed in. Must not import the rest of the gateway.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

SESSION_COOKIE = "tiergate_admin"
_CONTEXT = b"tiergate-admin-session-v1"


class SessionSigner:
    def __init__(self, admin_key: str, *, ttl_s: int = 8 * 3600, clock: Callable[[], float] = time.time) -> None:
        if not admin_key:
            raise ValueError("an admin key is required to sign sessions")
        self._key = hmac.new(admin_key.encode(), _CONTEXT, hashlib.sha256).digest()
        self.ttl_s = ttl_s
        self._clock = clock

    def _mac(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()

    def issue(self) -> str:
        payload = f"{int(self._clock()) + self.ttl_s}.{secrets.token_urlsafe(12)}"
        return f"{payload}.{self._mac(payload)}"

    def valid(self, token: str | None) -> bool:
        """True for an untampered token of this admin key that has not expired."""
        if not token or token.count(".") != 2:
            return False
        payload, _, mac = token.rpartition(".")
        if not hmac.compare_digest(mac.encode(), self._mac(payload).encode()):
            return False
        try:
            expires = int(payload.split(".", 1)[0])
        except ValueError:
            return False
        return self._clock() < expires
