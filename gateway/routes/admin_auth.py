"""The admin credential check, shared by the dashboard (login form, pages, JSON API), the budget
admin API and the key admin API: the admin key is the value of the environment variable named
by ``server.admin_key_env`` (unset: every admin call is 403).

Every check of an admin key a client sends — ``Authorization: Bearer`` on any admin route, or
the login form — goes through one ``LoginThrottle`` per process: after 10 wrong keys from one
client address within 5 minutes that address gets 429 (``retry-after``, OpenAI's shape) without
its key being compared, until the oldest failure leaves the window. A signed session cookie is
not a guess at the key (its MAC cannot be guessed) and is not throttled. The address is the
ASGI client, which uvicorn takes from ``X-Forwarded-For`` only for the proxies in
``server.forwarded_allow_ips``.

State-changing admin actions (``writer``, ``check_csrf``): a bearer admin key, or a session
cookie on a same-origin request carrying that session's CSRF token (form field ``csrf`` or header
``X-CSRF-Token``); each counted by one ``ActionLimiter`` per app (429 past 120 a minute per
client address). The ``Actor`` they return names the session or the bearer for the audit log.
Imports deps, errors, gateway.admin and gateway.console's ``Actor`` only.
"""

from __future__ import annotations

import hmac
import os
from urllib.parse import urlparse

from fastapi import Request

from gateway.admin import SESSION_COOKIE, ActionLimiter, LoginThrottle, SessionSigner
from gateway.console import Actor
from gateway.errors import AuthenticationFailed, PermissionDenied, RateLimited
from gateway.runtime import Runtime

CSRF_HEADER = "x-csrf-token"


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


def _limiter(request: Request) -> ActionLimiter:
    limiter: ActionLimiter | None = getattr(request.app.state, "admin_action_limiter", None)
    if limiter is None:
        limiter = request.app.state.admin_action_limiter = ActionLimiter()
    return limiter


def writer(request: Request) -> tuple[Runtime, Actor, str | None]:
    """For a state-changing admin request, before its body is read: the runtime, the actor and
    the session token (None for a bearer, whose caller needs no CSRF check; a session's caller
    must then call ``check_csrf``). 403 when disabled or cross-site, 401 without a valid key or
    session, 429 when throttled."""
    state: Runtime = request.app.state.tiergate
    key = admin_key(state)
    if key is None:
        raise disabled(state)
    given = bearer(request)
    token: str | None = None
    if given is not None:
        if not check_key(request, state, given, key):
            raise AuthenticationFailed("invalid admin key")
        who = "bearer"
    else:
        token = request.cookies.get(SESSION_COOKIE)
        if not SessionSigner(key).valid(token):
            raise AuthenticationFailed("admin login required")
        assert token is not None
        if not same_origin(request):
            raise PermissionDenied("cross-site request refused")
        who = f"session:{SessionSigner.session_id(token)}"
    wait = _limiter(request).take(client_address(request))
    if wait is not None:
        seconds = int(wait) + 1
        raise RateLimited(f"too many admin actions from this address; retry after {seconds} s",
                          headers={"retry-after": str(seconds)})
    return state, Actor(who, client_address(request)), token


def check_csrf(state: Runtime, token: str | None, given: str | None) -> None:
    """For a session (``token`` not None): 403 unless ``given`` is that session's CSRF token."""
    if token is None:
        return
    key = admin_key(state)
    if key is None or not SessionSigner(key).csrf_valid(token, given):
        raise PermissionDenied("missing or invalid CSRF token; reload the page and try again", code="invalid_csrf")


def csrf_for(request: Request, state: Runtime) -> str:
    """The CSRF token of the session this request carries ("" without one), for the forms."""
    key = admin_key(state)
    token = request.cookies.get(SESSION_COOKIE)
    if key is None or not token:
        return ""
    return SessionSigner(key).csrf_token(token)
