"""Key administration over HTTP: ``POST /admin/api/keys/{key_id}/revoke`` revokes an API key
(idempotent: revoking a revoked key answers its first revocation). Admin auth as the rest of
``/admin/api`` (gateway.routes.admin_auth); a request authenticated by the session cookie must
come from the dashboard's own origin.

The replica that answers forgets the key at once; every other replica refuses it at most
``server.key_cache_ttl_s`` after the revocation commits (gateway.auth). Imports deps, errors,
identifiers, admin_auth and db models only.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import anyio
import orjson
from fastapi import APIRouter, Depends, Request, Response

from gateway.db.models import ApiKey, utcnow
from gateway.errors import NotFound, PermissionDenied
from gateway.ids import Identifier
from gateway.routes.admin_auth import admin_json, bearer, same_origin
from gateway.runtime import Runtime

router = APIRouter(prefix="/admin/api/keys")


def _iso(ts: datetime) -> str:
    """A stored timestamp in ISO 8601 with its offset (SQLite hands them back naive, in UTC)."""
    return (ts if ts.tzinfo else ts.replace(tzinfo=UTC)).isoformat()


def _revoke(state: Runtime, key_id: str) -> tuple[dict[str, Any], str]:
    with state.session_factory.begin() as session:
        key = session.get(ApiKey, key_id)
        if key is None:
            raise NotFound(f"No API key with id '{key_id}'.", param="key_id")
        if key.revoked_at is None:
            key.revoked_at = utcnow()
        session.flush()
        body = {"id": key.id, "object": "api_key", "tenant_id": key.tenant_id, "name": key.name,
                "prefix": key.prefix, "created_at": _iso(key.created_at),
                "revoked_at": _iso(key.revoked_at), "revoked": True}
        return body, key.key_hash


@router.post("/{key_id}/revoke")
async def revoke_key(request: Request, key_id: Identifier, state: Runtime = Depends(admin_json)) -> Response:
    if bearer(request) is None and not same_origin(request):
        raise PermissionDenied("cross-site request refused")
    body, key_hash = await anyio.to_thread.run_sync(_revoke, state, key_id)
    state.keys.invalidate(key_hash)
    return Response(orjson.dumps(body), media_type="application/json", headers={"Cache-Control": "no-store"})
