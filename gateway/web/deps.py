"""Request-scoped dependencies for the routes: the process's ``Runtime`` and the authenticated
principal. Bodies are read with gateway.web.request_body, after these.

The runtime is ``app.state.tiergate``, opened by create_app's lifespan (gateway.runtime); routes
take their typed collaborators from it. Imports the runtime and auth types and starlette only.
"""

from __future__ import annotations

from fastapi import Request

from gateway.auth import Principal
from gateway.runtime import Runtime


def runtime_of(request: Request) -> Runtime:
    return request.app.state.tiergate  # type: ignore[no-any-return]


async def get_runtime(request: Request) -> Runtime:
    # async on purpose: FastAPI would run a plain ``def`` dependency in its thread pool.
    return runtime_of(request)


async def principal(request: Request) -> Principal:
    """The caller, from ``Authorization: Bearer <key>`` (raises AuthenticationFailed → 401)."""
    return await runtime_of(request).keys.authenticate(request.headers.get("authorization"))
