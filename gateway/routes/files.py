"""``/v1/files``: upload (multipart ``file`` + ``purpose=batch``), list, retrieve, content, delete.
Files are the caller's tenant's; another tenant's file is 404. Stored in the database (see
gateway.jobs.files). Imports deps, errors and gateway.jobs; no policy here.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from gateway.chat_flow import PrincipalLike
from gateway.deps import GatewayState, gateway_state, principal
from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.jobs.files import create_file, delete_file, file_json, get_file, list_files
from gateway.jobs.store import utc_now

router = APIRouter()
FORM_OVERHEAD_BYTES = 64 * 1024  # multipart boundaries and the purpose field
UPLOAD_PURPOSES = ("batch",)


def _tx(state: GatewayState, fn: Any, *args: Any) -> Any:
    with state.session_factory() as session, session.begin():
        return fn(session, *args)


async def _upload(request: Request, max_bytes: int) -> tuple[str, str, bytes]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes + FORM_OVERHEAD_BYTES:
        raise PayloadTooLarge(f"file is larger than the limit of {max_bytes} bytes", param="file")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequest("send the file as multipart/form-data", param="file")
    async with request.form(max_files=1, max_fields=8) as form:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("missing required parameter: 'file'", param="file",
                                 code="missing_required_parameter")
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest("purpose must be 'batch'", param="purpose", code="invalid_value")
        content = await upload.read(max_bytes + 1)
        if len(content) > max_bytes:
            raise PayloadTooLarge(f"file is larger than the limit of {max_bytes} bytes", param="file")
        return upload.filename or "upload.jsonl", purpose, content


@router.post("/v1/files")
async def upload_file(request: Request, state: GatewayState = Depends(gateway_state),
                      who: PrincipalLike = Depends(principal)) -> Any:
    filename, purpose, content = await _upload(request, state.settings.jobs.max_file_bytes)
    f = await run_in_threadpool(_tx, state, create_file, who.tenant_id, filename, purpose, content, utc_now())
    return file_json(f)


@router.get("/v1/files")
async def list_files_route(purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                           order: str = "desc", state: GatewayState = Depends(gateway_state),
                           who: PrincipalLike = Depends(principal)) -> Any:
    if not 1 <= limit <= 10_000:
        raise InvalidRequest("limit must be between 1 and 10000", param="limit")
    files = await run_in_threadpool(
        _tx, state, lambda s: list_files(s, who.tenant_id, purpose=purpose, limit=limit + 1, after=after,
                                         order=order))
    data = [file_json(f) for f in files[:limit]]
    return {"object": "list", "data": data, "has_more": len(files) > limit,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, state: GatewayState = Depends(gateway_state),
                        who: PrincipalLike = Depends(principal)) -> Any:
    return file_json(await run_in_threadpool(_tx, state, get_file, who.tenant_id, file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, state: GatewayState = Depends(gateway_state),
                       who: PrincipalLike = Depends(principal)) -> Response:
    f = await run_in_threadpool(_tx, state, get_file, who.tenant_id, file_id)
    return Response(f.content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def remove_file(file_id: str, state: GatewayState = Depends(gateway_state),
                      who: PrincipalLike = Depends(principal)) -> Any:
    await run_in_threadpool(_tx, state, delete_file, who.tenant_id, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
