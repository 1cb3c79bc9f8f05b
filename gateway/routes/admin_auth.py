"""The admin credential check, shared by the dashboard (login form, pages, JSON API), the budget
admin API and the key admin API: the admin key is the value of the environment variable named
by ``server.admin_key_env`` (unset: every admin call is 403).

Every check of an admin key a client sends — ``Authorization: Bearer`` on any admin route, or
the login form — goes through one ``LoginThrottle`` per process: after 10 wrong keys from one
client address within 5 minutes that address gets 429 (``retry-after``, OpenAI's shape) without
its key being compared, until the oldest failure leaves the window. A signed session cookie is
not a guess at the key (its MAC cannot be guessed) and is not throttled. The address is the
ASGI client, which uvicorn takes from ``X-Forwarded-For`` only for the proxies in
``server.forwarded_allow_ips``. Imports deps, errors and gateway.admin only.
"""

from __future__ import annotations

import hmac
import os
from urllib.parse import urlparse

from fastapi import Request

from gateway.admin import SESSION_COOKIE, LoginThrottle, SessionSigner
from gateway.errors import AuthenticationFailed, PermissionDenied, RateLimited
from gateway.runtime import Runtime


def admin_key(state: Runtime) -> str | None:
    return os.environ.get(state.settings.server.admin_key_env) or None


def disabled(state: Runtime) -> PermissionDenied:
    return PermissionDenied(f"admin API disabled: set the environment variable {state.settings.server.admin_key_env}")


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def throttle(state: Runtime) -> LoginThrottle:
    return state.admin_throttle


def throttled(request: Request, state: Runtime) -> RateLimited | None:
    """The 429 to answer when this client may not try an admin key now, else None."""
    wait = throttle(state).retry_after_s(client_address(request))
    if wait is None:
        return None
    seconds = int(wait) + 1
    return RateLimited(f"too many failed admin authentications from this address; retry after {seconds} s",
                       headers={"retry-after": str(seconds)})


def check_key(request: Request, state: Runtime, given: str, key: str) -> bool:
    """Compare a key the client sent with the admin key, throttled; False counts as a failure."""
    refused = throttled(request, state)
    if refused is not None:
        raise refused
    if hmac.compare_digest(given.encode(), key.encode()):
        throttle(state).succeeded(client_address(request))
        return True
    throttle(state).failed(client_address(request))
    return False


def bearer(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer`` header, or None without one."""
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


async def require_admin(request: Request) -> Runtime:
    """Dependency of the admin APIs that take the admin key only as a bearer token."""
    state: Runtime = request.app.state.tiergate
    key = admin_key(state)
    if key is None:
        raise disabled(state)
    given = bearer(request)
    if given is None or not check_key(request, state, given, key):
        raise AuthenticationFailed("invalid admin key")
    return state


def signed_in(request: Request, state: Runtime, key: str) -> bool:
    """A bearer admin key (checked, throttled: may raise RateLimited) or a valid session cookie."""
    given = bearer(request)
    if given is not None:
        return check_key(request, state, given, key)
    return SessionSigner(key).valid(request.cookies.get(SESSION_COOKIE))


async def admin_json(request: Request) -> Runtime:
    """Dependency of the dashboard's JSON API: 403 when disabled, 401 without a valid key or
    session, 429 while this client's wrong admin keys are throttled."""
    state: Runtime = request.app.state.tiergate
    key = admin_key(state)
    if key is None:
        raise disabled(state)
    if not signed_in(request, state, key):
        raise AuthenticationFailed("admin login required")
    return state


def same_origin(request: Request) -> bool:
    """False for a request another site's page made (its Origin names another host)."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    return urlparse(origin).netloc == request.headers.get("host", "")
