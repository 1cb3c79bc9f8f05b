"""Key administration over HTTP: ``POST /admin/api/keys/{key_id}/revoke`` revokes an API key
(idempotent: revoking a revoked key answers its first revocation), audited (gateway.console).
Admin auth as the other admin writes (gateway.routes.admin_auth.writer): a bearer admin key, or
the console's session cookie from its own origin with the session's ``X-CSRF-Token``.

The replica that answers forgets the key at once; every other replica refuses it at most
``server.key_cache_ttl_s`` after the revocation commits (gateway.auth). Imports console, ids,
admin_auth and the runtime only.
"""

from __future__ import annotations

import anyio
import orjson
from fastapi import APIRouter, Request, Response

from gateway import console
from gateway.ids import Identifier
from gateway.routes.admin_auth import CSRF_HEADER, check_csrf, writer

router = APIRouter(prefix="/admin/api/keys")


@router.post("/{key_id}/revoke")
async def revoke_key(request: Request, key_id: Identifier) -> Response:
    state, actor, token = writer(request)
    check_csrf(state, token, request.headers.get(CSRF_HEADER))
    body, key_hash = await anyio.to_thread.run_sync(console.revoke_key, state.session_factory, actor, key_id)
    state.keys.invalidate(key_hash)
    return Response(orjson.dumps(body), media_type="application/json", headers={"Cache-Control": "no-store"})
