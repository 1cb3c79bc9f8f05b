"""Request-scoped dependencies for the routes: the app's wiring (``GatewayState``) and the
authenticated principal. Bodies are read with gateway.request_body, after these.

Everything comes from ``app.state.tiergate``, set by create_app's lifespan (or by a test that
hands in small real collaborators). Imports errors, chat_flow types and starlette only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request

from gateway.chat_flow import ChatFlow, PrincipalLike
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
