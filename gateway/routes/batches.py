"""``/v1/batches``: create (validates the input file's JSONL first), retrieve, list, cancel.
The work itself runs in the jobs backend (embedded runner or Celery); this module only reads
and writes batch rows; ids are checked at the edge (gateway.ids) and the create body is
read after the key (gateway.web.request_body). Imports deps, errors, identifiers, request_body and
gateway.jobs.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, StringConstraints, field_validator
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from gateway.auth import Principal as PrincipalLike
from gateway.errors import InvalidRequest
from gateway.ids import Identifier, is_clean, is_storable
from gateway.jobs import store
from gateway.jobs.files import get_file
from gateway.jobs.validate import parse_batch_file
from gateway.runtime import Runtime
from gateway.web.deps import get_runtime, principal
from gateway.web.request_body import read_model

router = APIRouter()


MAX_CREATE_BYTES = 64 * 1024
# OpenAI's metadata limits: at most 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: Identifier
    endpoint: Annotated[str, StringConstraints(max_length=64)]
    completion_window: Annotated[str, StringConstraints(max_length=16)]
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs")
        for key, value in metadata.items():
            if not 0 < len(key) <= MAX_METADATA_KEY or not is_clean(key):
                raise ValueError(f"keys are 1 to {MAX_METADATA_KEY} characters, without control characters")
            if len(value) > MAX_METADATA_VALUE or not is_storable(value):
                raise ValueError(f"values are at most {MAX_METADATA_VALUE} characters, without NUL")
        return metadata


def _json(session: Session, batch: store.Batch) -> dict[str, Any]:
    return store.batch_json(batch, store.line_counts(session, [batch.id]).get(batch.id))


def _create(state: Runtime, who: PrincipalLike, body: BatchCreate) -> dict[str, Any]:
    store.check_batch_params(body.endpoint, body.completion_window)
    with state.session_factory() as session, session.begin():
        f = get_file(session, who.tenant_id, body.input_file_id, param="input_file_id")
        if f.purpose != "batch":
            raise InvalidRequest("the input file's purpose must be 'batch'", param="input_file_id")
        lines = parse_batch_file(f.content, body.endpoint, state.settings.jobs.max_lines,
                                 max_depth=state.settings.server.max_json_depth,
                                 unknown_fields=state.settings.server.unknown_fields)
        batch = store.create_batch(session, who.tenant_id, who.key_id, f.id, body.endpoint,
                                   body.completion_window, body.metadata, lines, store.utc_now())
        return store.batch_json(batch, None)


def _reread(state: Runtime, tenant_id: str, batch_id: str) -> dict[str, Any]:
    with state.session_factory() as session:
        return _json(session, store.get_batch(session, tenant_id, batch_id))


@router.post("/v1/batches")
async def create_batch(request: Request, state: Runtime = Depends(get_runtime),
                       who: PrincipalLike = Depends(principal)) -> Any:
    """Commit the batch, then hand it to the jobs backend. A batch the backend cannot take at once
    (the broker is down) is kept and queued when it can: the answer shows it ``validating`` with
    the reason in its ``errors``. The body is read only after the key is checked."""
    body = await read_model(request, state.settings.server, BatchCreate, max_bytes=MAX_CREATE_BYTES)
    created = await run_in_threadpool(_create, state, who, body)
    assert state.jobs is not None, "a gateway runtime has a jobs backend"
    if not await state.jobs.submit(created["id"]):
        return await run_in_threadpool(_reread, state, who.tenant_id, created["id"])
    return created


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: Identifier, state: Runtime = Depends(get_runtime),
                         who: PrincipalLike = Depends(principal)) -> Any:
    def read() -> dict[str, Any]:
        with state.session_factory() as session:
            return _json(session, store.get_batch(session, who.tenant_id, batch_id))
    return await run_in_threadpool(read)


@router.get("/v1/batches")
async def list_batches(after: Identifier | None = None, limit: int = 20, state: Runtime = Depends(get_runtime),
                       who: PrincipalLike = Depends(principal)) -> Any:
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be between 1 and 100", param="limit")

    def read() -> dict[str, Any]:
        with state.session_factory() as session:
            batches = store.list_batches(session, who.tenant_id, limit=limit + 1, after=after)
            counts = store.line_counts(session, [b.id for b in batches[:limit]])
            data = [store.batch_json(b, counts.get(b.id)) for b in batches[:limit]]
        return {"object": "list", "data": data, "has_more": len(batches) > limit,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}
    return await run_in_threadpool(read)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: Identifier, state: Runtime = Depends(get_runtime),
                       who: PrincipalLike = Depends(principal)) -> Any:
    """Pending lines are cancelled at once; running ones finish; the batch then becomes cancelled
    (right here when nothing is running)."""
    def cancel() -> dict[str, Any]:
        with state.session_factory() as session:
            return store.request_cancel(session, who.tenant_id, batch_id, store.utc_now())
    return await run_in_threadpool(cancel)
