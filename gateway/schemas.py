"""The OpenAI Chat Completions wire contract, as seen by tiergate's clients.

``ChatCompletionRequest`` validates what must be valid and lets unknown fields from newer
clients pass through (``extra="allow"``). Fields that would let a client choose the upstream
URL, key or headers are refused (no SSRF). Upstream responses are never round-tripped through
pydantic: they stay plain dicts on the fast path.

Imports only pydantic and gateway.errors; must not import fastapi, the db or providers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.errors import InvalidRequest

# Fields some gateways (litellm and friends) honour in the request body to redirect the call.
# tiergate never does: upstream URLs, keys and headers come from config.yaml only.
FORBIDDEN_UPSTREAM_FIELDS: frozenset[str] = frozenset({
    "api_base", "base_url", "api_key", "api_version", "api_type", "organization",
    "extra_headers", "headers", "custom_llm_provider", "litellm_params", "proxy",
    "azure_ad_token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
    "aws_region_name", "vertex_credentials", "vertex_project", "vertex_location",
    "mock_response", "user_config",
})

# Fields the gateway consumes itself and never forwards upstream.
GATEWAY_ONLY_FIELDS: frozenset[str] = frozenset({"model", "stream", "stream_options"})

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Open):
    include_usage: bool = False


class FunctionDef(_Open):
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_Open):
    model: str = Field(..., min_length=1, max_length=256)
    messages: list[Message] = Field(..., min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = Field(None, max_length=512)
    metadata: dict[str, str] | None = None
    reasoning_effort: Effort | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _stop_limit(self) -> ChatCompletionRequest:
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop: at most 4 sequences")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _param_from_loc(loc: tuple[int | str, ...]) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def parse_chat_request(data: Any) -> ChatCompletionRequest:
    """Validate a decoded JSON body; raise ``InvalidRequest`` with ``param`` on the first problem."""
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    for key in data:
        if key in FORBIDDEN_UPSTREAM_FIELDS:
            raise InvalidRequest(f"'{key}' is not accepted: upstreams are chosen by the gateway's configuration",
                                 param=key, code="unsupported_parameter")
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = _param_from_loc(tuple(first["loc"]))
        msg = first["msg"]
        if first["type"] == "missing":
            msg = f"missing required parameter: '{param}'"
        elif param:
            msg = f"invalid value for '{param}': {msg}"
        raise InvalidRequest(msg, param=param, code="missing_required_parameter"
                             if first["type"] == "missing" else "invalid_value") from None


def upstream_body(data: dict[str, Any]) -> dict[str, Any]:
    """The client's body as forwarded upstream: everything except gateway-only fields.

    The provider sets ``model`` (from config) and ``stream``/``stream_options`` itself."""
    return {k: v for k, v in data.items() if k not in GATEWAY_ONLY_FIELDS}
