"""Request-scoped dependencies for the routes: the app's wiring (``GatewayState``), the
authenticated principal, and the size-limited raw body.

Everything comes from ``app.state.tiergate``, set by create_app's lifespan (or by a test that
hands in small real collaborators). Imports errors, chat_flow types and starlette only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request

from gateway.chat_flow import ChatFlow, PrincipalLike
from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.settings import Settings


class KeyStoreLike(Protocol):
    async def authenticate(self, authorization_header: str | None) -> Any: ...


@dataclass
class GatewayState:
    settings: Settings
    flow: ChatFlow
    keys: KeyStoreLike
    ledger: Any
    registry: Any
    session_factory: Any
    extras: dict[str, Any] = field(default_factory=dict)  # other engineers' collaborators


async def gateway_state(request: Request) -> GatewayState:
    # async on purpose: FastAPI would run a plain ``def`` dependency in its thread pool.
    return request.app.state.tiergate  # type: ignore[no-any-return]


async def principal(request: Request) -> PrincipalLike:
    """The caller, from ``Authorization: Bearer <key>`` (raises AuthenticationFailed → 401)."""
    state: GatewayState = request.app.state.tiergate
    return await state.keys.authenticate(request.headers.get("authorization"))  # type: ignore[no-any-return]


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refusing more than ``max_bytes`` before reading it (Content-Length) and
    while reading it (chunked uploads), so an oversized body is never buffered or parsed."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidRequest("invalid Content-Length header") from None
        if size > max_bytes:
            raise PayloadTooLarge(f"request body is larger than the limit of {max_bytes} bytes")
    parts: list[bytes] = []
    total = 0
    async for part in request.stream():
        total += len(part)
        if total > max_bytes:
            raise PayloadTooLarge(f"request body is larger than the limit of {max_bytes} bytes")
        parts.append(part)
    return b"".join(parts)
