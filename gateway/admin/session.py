"""Admin session tokens: ``<expires>.<nonce>.<hmac>`` signed with a key derived from the
admin key, so rotating the admin key logs every session out; each session's CSRF token is a MAC
of its session token (``csrf_token``), checked on every console form and cookie-authenticated
JSON write. Pure: no web framework, no
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
_CSRF = "csrf|"


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

    def csrf_token(self, token: str) -> str:
        """The anti-forgery token of one session: a MAC of the session token, so it is tied to that
        session (another session's, or a forged one, does not match) and needs no storage."""
        return self._mac(_CSRF + token)

    def csrf_valid(self, token: str | None, given: str | None) -> bool:
        if not token or not given:
            return False
        return hmac.compare_digest(given.encode(), self.csrf_token(token).encode())

    @staticmethod
    def session_id(token: str) -> str:
        """A short, non-secret name of a session for the audit log (from its nonce, not its MAC)."""
        parts = token.split(".")
        return parts[1][:8] if len(parts) == 3 else "?"
