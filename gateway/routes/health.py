"""``/healthz`` (the process answers) and ``/readyz``: 200 ``ok`` (database reachable, ledger
healthy), 200 ``degraded`` (the database is away, requests are still served and their spend
journaled), 503 ``unavailable`` (the ledger's journal cannot be written: new requests are refused)."""

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
    # The database away with the journal writable is "degraded": requests are still served (keys
    # and budgets from their caches, spend to the journal, drained when the database is back).
    # A journal that cannot be written is "unavailable": new requests are refused (503).
    serving = health.journal_ok
    status = "unavailable" if not serving else "ok" if db and ledger else "degraded"
    body = {"status": status, "database": db, "ledger": ledger,
            "ledger_state": {"pending_db": health.pending_db, "open_intents": health.open_intents,
                             "owners_to_settle": health.owners_to_settle,
                             "interrupted_settled": health.interrupted_settled}}
    return Response(orjson.dumps(body), status_code=200 if serving else 503, media_type="application/json")
