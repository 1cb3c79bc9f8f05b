"""``GET /v1/models`` and ``GET /v1/models/{id}``: auto, one name per tier, every configured model."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Depends, Response

from gateway.auth import Principal as PrincipalLike
from gateway.errors import ModelNotFound
from gateway.routing import public_model_names
from gateway.runtime import Runtime
from gateway.web.deps import get_runtime, principal

router = APIRouter()


def _card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tiergate"}


@router.get("/v1/models")
async def list_models(state: Runtime = Depends(get_runtime),
                      _: PrincipalLike = Depends(principal)) -> Response:
    body = {"object": "list", "data": [_card(n) for n in public_model_names(state.settings)]}
    return Response(orjson.dumps(body), media_type="application/json")


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: Runtime = Depends(get_runtime),
                    _: PrincipalLike = Depends(principal)) -> Response:
    if model_id not in public_model_names(state.settings):
        raise ModelNotFound(f"The model '{model_id[:100]}' does not exist", param="model")
    return Response(orjson.dumps(_card(model_id)), media_type="application/json")
