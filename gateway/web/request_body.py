"""The one way a route reads its request body, called only after the caller is authenticated
(the route's auth dependency, or ``authenticate`` first in a plain route): at most ``max_bytes``
(refused by Content-Length before a byte is read, and again while reading a chunked body),
within a read timeout (a client that trickles its body gets a 408 and the connection is closed),
then — for JSON — parsed with the nesting-depth limit of gateway.client_json and, for a model,
validated into a 400 that names the param. Multipart uploads (``read_form``) stream through the
same size and time limits into Starlette's form parser, which spools file parts to disk past
1 MiB, so nothing past the limit is ever buffered.

Every error is a GatewayError in OpenAI's shape. Imports starlette, pydantic, settings, errors
and client_json only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import Message, Receive

from gateway import client_json
from gateway.errors import InvalidRequest, PayloadTooLarge, RequestTimeout
from gateway.settings import ServerSettings

M = TypeVar("M", bound=BaseModel)
FORM_OVERHEAD_BYTES = 64 * 1024  # multipart boundaries and small fields around an uploaded file


def _too_large(max_bytes: int, param: str | None) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is larger than the limit of {max_bytes} bytes", param=param)


def _check_declared(request: Request, max_bytes: int, param: str | None = None) -> None:
    declared = request.headers.get("content-length")
    if declared is None:
        return
    if not declared.isdigit():
        raise InvalidRequest("invalid Content-Length header")
    if int(declared) > max_bytes:
        raise _too_large(max_bytes, param)


def _timed_out(timeout_s: float) -> RequestTimeout:
    return RequestTimeout(f"the request body did not arrive within {timeout_s:g} s")


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The raw body: at most ``max_bytes``, all of it within ``timeout_s``."""
    _check_declared(request, max_bytes)
    parts: list[bytes] = []
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                total += len(part)
                if total > max_bytes:
                    raise _too_large(max_bytes, None)
                parts.append(part)
    except TimeoutError:
        raise _timed_out(timeout_s) from None
    return b"".join(parts)


async def read_json(request: Request, server: ServerSettings, *, max_bytes: int | None = None) -> Any:
    """The body parsed as JSON under ``server``'s limits (``max_bytes`` may lower the size limit)."""
    limit = server.max_body_bytes if max_bytes is None else min(max_bytes, server.max_body_bytes)
    raw = await read_body(request, limit, server.body_read_timeout_s)
    return client_json.loads(raw, max_depth=server.max_json_depth)


def param_of(loc: tuple[Any, ...]) -> str | None:
    """A pydantic/FastAPI error location as OpenAI names a param: ``messages[0].role``, ``batch_id``."""
    out = ""
    for part in loc:
        if part in ("body", "path", "query", "header", "cookie") and not out:
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def invalid_value(err: dict[str, Any]) -> InvalidRequest:
    """The 400 for one pydantic error (its message never quotes the input)."""
    param = param_of(tuple(err.get("loc", ())))
    if err.get("type") == "missing":
        return InvalidRequest(f"missing required parameter: '{param}'", param=param,
                              code="missing_required_parameter")
    if err.get("type") == "extra_forbidden":
        return InvalidRequest(f"unknown parameter: '{param}'", param=param, code="unknown_parameter")
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return InvalidRequest(f"invalid value for '{param}': {msg}", param=param, code="invalid_value")


def parse_model(model: type[M], data: Any) -> M:
    """``data`` (a parsed JSON body) validated into ``model``; a 400 naming the first bad param."""
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise invalid_value(dict(err.errors()[0])) from None


async def read_model(request: Request, server: ServerSettings, model: type[M], *,
                     max_bytes: int | None = None) -> M:
    return parse_model(model, await read_json(request, server, max_bytes=max_bytes))


def _counting(receive: Receive, max_bytes: int, param: str | None) -> Receive:
    total = 0

    async def counted() -> Message:
        nonlocal total
        message = await receive()
        if message["type"] == "http.request":
            total += len(message.get("body", b""))
            if total > max_bytes:
                raise _too_large(max_bytes, param)
        return message

    return counted


@asynccontextmanager
async def read_form(request: Request, *, max_bytes: int, timeout_s: float, param: str,
                    max_files: int = 1, max_fields: int = 8) -> AsyncIterator[FormData]:
    """A multipart/urlencoded form of at most ``max_bytes`` that arrived within ``timeout_s``;
    its files are closed on exit. A malformed body is a 400 naming ``param``."""
    _check_declared(request, max_bytes, param)
    limited = Request(request.scope, _counting(request.receive, max_bytes, param))
    try:
        async with asyncio.timeout(timeout_s):
            form = await limited.form(max_files=max_files, max_fields=max_fields)
    except TimeoutError:
        raise _timed_out(timeout_s) from None
    except HTTPException as err:  # Starlette's wrapper of python-multipart's errors
        raise InvalidRequest(f"invalid multipart body: {err.detail}", param=param, code="invalid_multipart") from None
    try:
        yield form
    finally:
        await form.close()
