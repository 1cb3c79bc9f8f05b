"""A small OpenAI-compatible server for one local engine model (`tiergate engine serve`).

POST /v1/chat/completions (JSON or SSE streaming ending in ``data: [DONE]``, with
``stream_options.include_usage``), GET /v1/models, GET /healthz. It reuses
`LocalEngineProvider`, so it answers exactly as the gateway's in-process path does; no
auth, ledger or budgets (put the gateway in front for those).

Imports FastAPI, the provider and errors; must not import the database or the pipeline.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.errors import GatewayError, InvalidRequest, ModelNotFound
from gateway.providers.base import CallOptions
from gateway.providers.local import LocalEngineProvider
from gateway.settings import ModelSettings


def create_engine_app(model_dir: str | Path, *, model_name: str | None = None,
                      provider: LocalEngineProvider | None = None, context_window: int = 2048,
                      experts_per_token: int | None = None, quantization: str = "none") -> FastAPI:
    """The app for one model directory (or GGUF file); the engine loads in the lifespan (or on first use)."""
    path = Path(model_dir).resolve()
    name = model_name or path.name
    model = ModelSettings(provider="local", model=str(path), context_window=context_window,
                          engine={"quantization": quantization})
    local = provider or LocalEngineProvider(base_dir=path.parent)
    options = CallOptions(experts_per_token=experts_per_token)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await local.engine_for(model)
        yield
        await local.aclose()

    app = FastAPI(title="tiergate engine", lifespan=lifespan)

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, err: GatewayError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tiergate"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> JSONResponse | StreamingResponse:
        try:
            body = await request.json()
        except ValueError:
            raise InvalidRequest("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequest("the body must be a JSON object")
        requested = body.get("model")
        if requested not in (None, name):
            raise ModelNotFound(f"The model '{str(requested)[:100]}' does not exist; this server serves {name!r}.",
                                param="model")
        body = {**body, "model": name}
        if not body.get("stream"):
            return JSONResponse(await local.complete(model, body, options))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = local.stream(model, body, options)
        first = await anext(chunks)  # errors before the first chunk become a normal error response
        return StreamingResponse(_sse(first, chunks, include_usage), media_type="text/event-stream")

    return app


async def _sse(first: dict[str, Any], chunks: AsyncIterator[dict[str, Any]],
               include_usage: bool) -> AsyncIterator[bytes]:
    try:
        yield _event(first)
        async for chunk in chunks:
            if not chunk["choices"] and "usage" in chunk and not include_usage:
                continue
            yield _event(chunk)
        yield b"data: [DONE]\n\n"
    except GatewayError as err:
        yield _event(err.body())
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
