"""``/v1/files``: upload (multipart ``file`` + ``purpose=batch``), list, retrieve, content, delete.
Files are the caller's tenant's; another tenant's file is 404. Stored in the database (see
gateway.jobs.files). Ids and file names are checked at the edge (gateway.ids); the upload
streams under the file size limit and read timeout (gateway.web.request_body). Imports deps, errors,
identifiers, request_body and gateway.jobs; no policy here.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from gateway.auth import Principal as PrincipalLike
from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.ids import FORBIDDEN_MESSAGE, Identifier, is_clean
from gateway.jobs.files import create_file, delete_file, file_json, get_file, list_files
from gateway.jobs.store import utc_now
from gateway.runtime import Runtime
from gateway.web.deps import get_runtime, principal
from gateway.web.request_body import FORM_OVERHEAD_BYTES, read_form

router = APIRouter()
UPLOAD_PURPOSES = ("batch",)


def _tx(state: Runtime, fn: Any, *args: Any) -> Any:
    with state.session_factory() as session, session.begin():
        return fn(session, *args)


async def _upload(request: Request, state: Runtime) -> tuple[str, str, bytes]:
    """(file name, purpose, content) of a multipart upload, streamed under the file size limit
    (``jobs.max_file_bytes``) and the upload read timeout."""
    jobs = state.settings.jobs
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequest("send the file as multipart/form-data", param="file", code="invalid_multipart")
    async with read_form(request, max_bytes=jobs.max_file_bytes + FORM_OVERHEAD_BYTES,
                         timeout_s=jobs.upload_read_timeout_s, param="file") as form:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("missing required parameter: 'file'", param="file",
                                 code="missing_required_parameter")
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest("purpose must be 'batch'", param="purpose", code="invalid_value")
        filename = upload.filename or "upload.jsonl"
        if not is_clean(filename):
            raise InvalidRequest(f"the file name {FORBIDDEN_MESSAGE}", param="file", code="invalid_value")
        content = await upload.read(jobs.max_file_bytes + 1)
        if len(content) > jobs.max_file_bytes:
            raise PayloadTooLarge(f"file is larger than the limit of {jobs.max_file_bytes} bytes", param="file")
        return filename, str(purpose), content


@router.post("/v1/files")
async def upload_file(request: Request, state: Runtime = Depends(get_runtime),
                      who: PrincipalLike = Depends(principal)) -> Any:
    filename, purpose, content = await _upload(request, state)
    f = await run_in_threadpool(_tx, state, create_file, who.tenant_id, filename, purpose, content, utc_now())
    return file_json(f)


@router.get("/v1/files")
async def list_files_route(purpose: Identifier | None = None, limit: int = 10_000, after: Identifier | None = None,
                           order: str = "desc", state: Runtime = Depends(get_runtime),
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
async def retrieve_file(file_id: Identifier, state: Runtime = Depends(get_runtime),
                        who: PrincipalLike = Depends(principal)) -> Any:
    return file_json(await run_in_threadpool(_tx, state, get_file, who.tenant_id, file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: Identifier, state: Runtime = Depends(get_runtime),
                       who: PrincipalLike = Depends(principal)) -> Response:
    f = await run_in_threadpool(_tx, state, get_file, who.tenant_id, file_id)
    return Response(f.content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def remove_file(file_id: Identifier, state: Runtime = Depends(get_runtime),
                      who: PrincipalLike = Depends(principal)) -> Any:
    await run_in_threadpool(_tx, state, delete_file, who.tenant_id, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
