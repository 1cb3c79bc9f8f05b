"""Tenant-scoped files stored in the database (``files`` table) and their OpenAI wire shape.

Every lookup takes the tenant: another tenant's file is "not found", never "forbidden".
Plain functions on a caller's Session; imports the jobs tables, ids and errors only.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from gateway.db.models import FileObject
from gateway.errors import InvalidRequest, NotFound
from gateway.ids import fast_id

PURPOSES = ("batch", "batch_output")  # what this gateway accepts / produces
MAX_LIST = 10_000


def new_file_id() -> str:
    return "file-" + fast_id()


def unix(ts: datetime | None) -> int | None:
    """Epoch seconds of a stored timestamp (SQLite hands them back naive, in UTC)."""
    if ts is None:
        return None
    return int((ts if ts.tzinfo else ts.replace(tzinfo=UTC)).timestamp())


def file_json(f: FileObject) -> dict[str, Any]:
    return {"id": f.id, "object": "file", "bytes": f.size, "created_at": unix(f.created_at),
            "filename": f.filename, "purpose": f.purpose, "status": "processed", "status_details": None}


def create_file(session: Session, tenant_id: str, filename: str, purpose: str, content: bytes,
                now: datetime) -> FileObject:
    f = FileObject(id=new_file_id(), tenant_id=tenant_id, purpose=purpose, filename=filename[:255] or "upload",
                   size=len(content), content=content, created_at=now)
    session.add(f)
    session.flush()
    return f


def get_file(session: Session, tenant_id: str, file_id: str, *, param: str = "file_id") -> FileObject:
    f = session.get(FileObject, file_id)
    if f is None or f.tenant_id != tenant_id:
        raise NotFound(f"No such File object: {file_id}", param=param)
    return f


def list_files(session: Session, tenant_id: str, *, purpose: str | None = None, limit: int = MAX_LIST,
               after: str | None = None, order: str = "desc") -> list[FileObject]:
    cols = (FileObject.id, FileObject.tenant_id, FileObject.purpose, FileObject.filename, FileObject.size,
            FileObject.created_at)
    q = sa.select(FileObject).options(sa.orm.load_only(*cols)).where(FileObject.tenant_id == tenant_id)
    if purpose is not None:
        q = q.where(FileObject.purpose == purpose)
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
    if after is not None:
        cursor = get_file(session, tenant_id, after, param="after")
        key, mark = sa.tuple_(FileObject.created_at, FileObject.id), sa.tuple_(cursor.created_at, cursor.id)
        q = q.where(key < mark if order == "desc" else key > mark)
    by = (FileObject.created_at.desc(), FileObject.id.desc()) if order == "desc" else \
        (FileObject.created_at.asc(), FileObject.id.asc())
    return list(session.scalars(q.order_by(*by).limit(limit)))


def delete_file(session: Session, tenant_id: str, file_id: str) -> None:
    session.delete(get_file(session, tenant_id, file_id))
