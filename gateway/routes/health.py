"""``/healthz`` (the process answers) and ``/readyz`` (database reachable, ledger healthy)."""

from __future__ import annotations

import logging

import anyio
import orjson
import sqlalchemy as sa
from fastapi import APIRouter, Depends, Response

from gateway.runtime import Runtime
from gateway.web.deps import get_runtime

router = APIRouter()
log = logging.getLogger("tiergate.health")


@router.get("/healthz")
async def healthz() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


def _db_ok(state: Runtime) -> bool:
    try:
        with state.session_factory() as session:
            session.execute(sa.text("SELECT 1"))
        return True
    except Exception as err:  # readiness reports, it does not raise
        log.warning("readiness: database check failed (%s)", type(err).__name__)
        return False


@router.get("/readyz")
async def readyz(state: Runtime = Depends(get_runtime)) -> Response:
    db = await anyio.to_thread.run_sync(_db_ok, state)
    health = state.ledger.health()
    ledger = health.ok
    ok = db and ledger
    body = {"status": "ok" if ok else "unavailable", "database": db, "ledger": ledger,
            "ledger_state": {"pending_db": health.pending_db, "open_intents": health.open_intents,
                             "owners_to_settle": health.owners_to_settle,
                             "interrupted_settled": health.interrupted_settled}}
    return Response(orjson.dumps(body), status_code=200 if ok else 503, media_type="application/json")
