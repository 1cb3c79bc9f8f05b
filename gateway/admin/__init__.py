"""The admin dashboard's web assets and its signed session cookie.

``session``: HMAC-signed, expiring session tokens derived from the admin key; ``throttle``:
failed-login and admin-action limiting per client address; ``charts``: inline-SVG charts. ``templates/``
(Jinja2, autoescaped) and ``static/`` (one CSS, one small JS; no CDN, no build step) are
read by gateway.routes.admin. Imports nothing from the rest of the gateway.
"""

from gateway.admin.session import SESSION_COOKIE, SessionSigner
from gateway.admin.throttle import ActionLimiter, LoginThrottle

__all__ = ["SESSION_COOKIE", "ActionLimiter", "LoginThrottle", "SessionSigner"]
