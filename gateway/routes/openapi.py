"""The OpenAPI 3.1 document of the ``/v1`` surface, served at ``GET /openapi.json``.

Request bodies are the very models the routes validate with (``ChatCompletionRequest``,
``BatchCreate``, ``FeedbackBody``); responses are described by the small models below, loose
where OpenAI's own objects are (extra fields allowed), and every status a route can answer is
listed with OpenAI's error shape. The test suite runs schemathesis against this document
(``tests/gateway/app/test_openapi_fuzz.py``): no 5xx, every response conforming.

Built once per process, on first request. Imports schemas and the sibling routes' body models.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict

from gateway.routing import public_model_names
from gateway.schemas import ChatCompletionRequest

router = APIRouter()

ERROR_STATUSES = {
    "400": "Invalid request (the param is named)", "401": "Missing or invalid API key",
    "404": "Not found", "408": "The request was not received in time", "413": "Body too large",
    "429": "Rate limit or budget exceeded", "499": "The client closed the connection",
    "502": "The upstream model failed", "503": "Temporarily unavailable", "504": "The upstream timed out",
}


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Model(_Loose):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Loose):
    object: Literal["list"]
    data: list[Model]


class ChatMessageOut(_Loose):
    role: Literal["assistant"]
    content: str | None = None


class ChatChoice(_Loose):
    index: int
    message: ChatMessageOut
    finish_reason: str | None = None


class Usage(_Loose):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(_Loose):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FileObject(_Loose):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str


class FileList(_Loose):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool


class FileDeleted(_Loose):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Batch(_Loose):
    id: str
    object: Literal["batch"]
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    request_counts: RequestCounts


class BatchList(_Loose):
    object: Literal["list"]
    data: list[Batch]
    has_more: bool


class FeedbackAccepted(_Loose):
    request_id: str


class FileUpload(BaseModel):
    file: bytes
    purpose: Literal["batch"]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


def _responses(ok: str | dict[str, Any], *errors: str) -> dict[str, Any]:
    content = _json(ok) if isinstance(ok, str) else ok
    out: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for status in ("400", "401", "408", "413", "429", "503", *errors):
        out[status] = {"description": ERROR_STATUSES[status], "content": _json("ErrorResponse")}
    return out


def _id(name: str, where: str = "path") -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path",
            "schema": {"type": "string", "minLength": 1, "maxLength": 256}}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def _body(name: str) -> dict[str, Any]:
    return {"required": True, "content": _json(name)}


def _paths() -> dict[str, Any]:
    # Each server-sent event: ``data`` is a chat.completion.chunk as JSON text, or ``[DONE]``.
    sse = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}}}
    listing = [_query("after", {"type": "string", "maxLength": 256}),
               _query("limit", {"type": "integer"})]
    return {
        "/v1/models": {"get": {"operationId": "listModels", "responses": _responses("ModelList", "404")}},
        "/v1/models/{model}": {"get": {"operationId": "retrieveModel", "parameters": [_id("model")],
                                       "responses": _responses("Model", "404")}},
        "/v1/chat/completions": {"post": {
            "operationId": "createChatCompletion", "requestBody": _body("ChatCompletionRequest"),
            "responses": _responses({**_json("ChatCompletion"), **sse}, "404", "499", "502", "504")}},
        "/v1/feedback": {"post": {"operationId": "createFeedback", "requestBody": _body("FeedbackBody"),
                                  "responses": _responses("FeedbackAccepted", "404")}},
        "/v1/files": {
            "post": {"operationId": "createFile", "requestBody": {"required": True, "content": {
                "multipart/form-data": {"schema": _ref("FileUpload")}}}, "responses": _responses("FileObject")},
            "get": {"operationId": "listFiles",
                    "parameters": [_query("purpose", {"type": "string", "maxLength": 64}), *listing,
                                   _query("order", {"type": "string", "enum": ["asc", "desc"]})],
                    "responses": _responses("FileList", "404")}},
        "/v1/files/{file_id}": {
            "get": {"operationId": "retrieveFile", "parameters": [_id("file_id")],
                    "responses": _responses("FileObject", "404")},
            "delete": {"operationId": "deleteFile", "parameters": [_id("file_id")],
                       "responses": _responses("FileDeleted", "404")}},
        "/v1/files/{file_id}/content": {"get": {
            "operationId": "downloadFile", "parameters": [_id("file_id")],
            "responses": _responses({"application/octet-stream": {"schema": {"type": "string"}}}, "404")}},
        "/v1/batches": {
            "post": {"operationId": "createBatch", "requestBody": _body("BatchCreate"),
                     "responses": _responses("Batch", "404")},
            "get": {"operationId": "listBatches", "parameters": listing,
                    "responses": _responses("BatchList", "404")}},
        "/v1/batches/{batch_id}": {"get": {"operationId": "retrieveBatch", "parameters": [_id("batch_id")],
                                           "responses": _responses("Batch", "404")}},
        "/v1/batches/{batch_id}/cancel": {"post": {"operationId": "cancelBatch", "parameters": [_id("batch_id")],
                                                   "responses": _responses("Batch", "404")}},
    }


def _components() -> dict[str, Any]:
    from gateway.routes.batches import BatchCreate
    from gateway.routes.feedback import FeedbackBody

    models: list[type[BaseModel]] = [ChatCompletionRequest, BatchCreate, FeedbackBody, ErrorResponse, Model,
                                     ModelList, ChatCompletion, FileObject, FileList, FileDeleted, Batch,
                                     BatchList, FeedbackAccepted, FileUpload]
    schemas: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def openapi_document(version: str, model_names: tuple[str, ...] = ()) -> dict[str, Any]:
    """The document; ``model_names`` (this gateway's public names) become the enum of ``model``."""
    components = _components()
    if model_names:
        model = components["ChatCompletionRequest"]["properties"]["model"]
        model["enum"] = list(model_names)
    return {
        "openapi": "3.1.0",
        "info": {"title": "tiergate", "version": version,
                 "description": "OpenAI-compatible gateway: Chat Completions, Models, Files and Batches."},
        "servers": [{"url": "/"}],
        "paths": _paths(),
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


@cache
def _document_bytes(model_names: tuple[str, ...]) -> bytes:
    try:
        version = package_version("tiergate")
    except PackageNotFoundError:
        version = "0"
    return orjson.dumps(openapi_document(version, model_names))


@router.get("/openapi.json", include_in_schema=False)
async def openapi_json(request: Request) -> Response:
    settings = request.app.state.tiergate.settings
    return Response(_document_bytes(tuple(public_model_names(settings))), media_type="application/json")
