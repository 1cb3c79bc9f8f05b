"""The admin dashboard's web assets and its signed session cookie.

``session``: HMAC-signed, expiring session tokens derived from the admin key. ``templates/``
(Jinja2, autoescaped) and ``static/`` (one CSS, one small JS; no CDN, no build step) are
read by gateway.routes.admin. Imports nothing from the rest of the gateway.
"""

from gateway.admin.session import SESSION_COOKIE, SessionSigner

__all__ = ["SESSION_COOKIE", "SessionSigner"]
