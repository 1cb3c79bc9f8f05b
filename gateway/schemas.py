"""The OpenAI Chat Completions wire contract, as seen by tiergate's clients: an allow-list.

``ChatCompletionRequest`` is strict: every field a client may send is declared here with its
type and bounds (no string-to-number coercion: ``"temperature": "0.5"`` is a 400 naming
``temperature``), and a field that is not declared — at any depth: top level, a message, a
content part, a tool — is refused with a 400 naming it (``unsupported_parameter``), or, with
``server.unknown_fields: drop``, removed before validation and never forwarded. What reaches a
provider is re-encoded from the validated model (``forwardable``), never taken from the raw
body, and then cut down again to that provider type's own allow-list
(``gateway.providers.payload``). Nothing a client sends can choose an upstream URL, key, header,
fallback, retry policy or price: no such field exists here.

Refused on purpose even though OpenAI knows them, because they would bill the operator for
something tiergate does not price or would reach another tenant's data: ``audio`` output and
``modalities: ["audio"]``, ``web_search_options``, ``service_tier`` other than auto/default,
and ``file_id`` content parts (a file in the operator's provider account).

Imports only pydantic and gateway.errors; must not import fastapi, the db or providers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.errors import InvalidRequest

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
UnknownFields = Literal["reject", "drop"]

# Consumed by the gateway itself, never forwarded as they came: ``model`` is replaced by the
# configured upstream name, ``stream``/``stream_options`` are set by the provider. (The
# ``tiergate`` extension object stays in the body for the executors; no provider takes it.)
GATEWAY_ONLY_FIELDS: frozenset[str] = frozenset({"model", "stream", "stream_options"})

MAX_TOKENS_LIMIT = 1 << 31  # larger than any context window; keeps arithmetic on holds small
INT64 = 1 << 63

_WHY_REFUSED: dict[str, str] = {
    "audio": "audio output is not supported (tiergate does not price audio tokens)",
    "web_search_options": "web search is not supported (tiergate does not price search calls)",
    "api_base": "upstreams are chosen by the gateway's configuration",
    "base_url": "upstreams are chosen by the gateway's configuration",
    "api_key": "upstream credentials come from the gateway's configuration",
    "fallbacks": "fallbacks are configured per tier by the operator",
    "file_id": "files are sent inline as file_data; a file id would name a file in the operator's account",
}


class _Wire(BaseModel):
    """Strict: declared fields only, exact JSON types (ints are accepted where floats are)."""

    model_config = ConfigDict(extra="forbid", strict=True)


# -- message content --------------------------------------------------------------------------
class TextPart(_Wire):
    type: Literal["text"]
    text: str


class ImageURL(_Wire):
    url: str = Field(..., min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Wire):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Wire):
    data: str
    format: Literal["wav", "mp3"]


class AudioPart(_Wire):
    type: Literal["input_audio"]
    input_audio: InputAudio


class InlineFile(_Wire):
    """A file sent inline (``file_data``). ``file_id`` would name a file in the operator's
    provider account — possibly another tenant's — so it is not accepted."""

    file_data: str = Field(..., min_length=1)
    filename: str | None = Field(None, max_length=256)


class FilePart(_Wire):
    type: Literal["file"]
    file: InlineFile


class RefusalPart(_Wire):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[TextPart | ImagePart | AudioPart | FilePart | RefusalPart, Field(discriminator="type")]


class FunctionCall(_Wire):
    name: str = Field(..., max_length=64)
    arguments: str


class ToolCall(_Wire):
    id: str = Field(..., max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


_TEXT_ONLY_ROLES = frozenset({"system", "developer", "tool", "function"})


class Message(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, max_length=256)
    refusal: str | None = None
    function_call: FunctionCall | None = None

    @model_validator(mode="after")
    def _by_role(self) -> Message:
        parts = self.content if isinstance(self.content, list) else []
        if self.role in _TEXT_ONLY_ROLES and any(p.type != "text" for p in parts):
            raise ValueError(f"{self.role} messages take text content parts only")
        if self.role == "assistant" and any(p.type not in ("text", "refusal") for p in parts):
            raise ValueError("assistant messages take text or refusal content parts only")
        if self.role == "user" and any(p.type == "refusal" for p in parts):
            raise ValueError("refusal content parts belong to assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool messages need tool_call_id")
        if self.role != "assistant" and (self.tool_calls or self.refusal or self.function_call):
            raise ValueError("tool_calls, refusal and function_call belong to assistant messages")
        if self.role in ("user", "system", "developer") and self.content is None:
            raise ValueError(f"{self.role} messages need content")
        return self


# -- tools and output formats -----------------------------------------------------------------
class FunctionDef(_Wire):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Wire):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Wire):
    name: str = Field(..., min_length=1, max_length=64)


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Wire):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True, serialize_by_alias=True)


class ResponseFormatText(_Wire):
    type: Literal["text"]


class ResponseFormatJSONObject(_Wire):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(_Wire):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
                           Field(discriminator="type")]


class Prediction(_Wire):
    type: Literal["content"]
    content: str | list[TextPart]


class StreamOptions(_Wire):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class TiergateOptions(_Wire):
    """The ``tiergate`` extension object (the OpenAI SDK's ``extra_body={"tiergate": {...}}``)."""

    pipeline: Literal["auto", "on", "off"] | bool = "auto"
    max_cost_usd: float | None = Field(None, gt=0, le=1e6)


# -- the request ------------------------------------------------------------------------------
class ChatCompletionRequest(_Wire):
    model: str = Field(..., min_length=1, max_length=256)
    messages: list[Message] = Field(..., min_length=1, max_length=4096)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    user: str | None = Field(None, max_length=512)
    safety_identifier: str | None = Field(None, max_length=512)
    prompt_cache_key: str | None = Field(None, max_length=512)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    reasoning_effort: Effort | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = Field(None, max_length=128)
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, int] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Sampling extensions that vLLM, SGLang and the bundled engine accept; forwarded only to
    # models that list them under ``extra_params`` in config.yaml.
    top_k: int | None = Field(None, ge=0, le=100_000)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    tiergate: TiergateOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(len(s) > 512 for s in ([value] if isinstance(value, str) else value or [])):
            raise ValueError("a stop sequence is at most 512 characters")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limit(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("at most 16 pairs, keys up to 64 and values up to 512 characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_limit(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        if value is not None and (len(value) > 1024 or any(not k.isdigit() or not -100 <= v <= 100
                                                            for k, v in value.items())):
            raise ValueError("token ids (digits) to integers in [-100, 100], at most 1024 entries")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def output_tokens_asked(self) -> int | None:
        """What the client capped each choice's output at (``max_completion_tokens`` wins)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def forwardable(self) -> dict[str, Any]:
        """The fields a provider may receive, as plain JSON values re-encoded from this validated
        model (only what the client set; gateway-only fields left out)."""
        return self.model_dump(exclude_unset=True, exclude=set(GATEWAY_ONLY_FIELDS), by_alias=True)


# -- parsing ----------------------------------------------------------------------------------
_TYPE_WORDS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _data_path(data: Any, loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """``loc`` of a validation error with pydantic's union-member names taken out, so that it
    names the place in the client's JSON: ``("messages", 0, "content", "list[...]", 0, "text",
    "bad")`` → ``("messages", 0, "content", 0, "bad")`` (the second ``"text"`` was the tag of
    the content part that was tried)."""
    out: list[int | str] = []
    node: Any = data
    parts = list(loc)
    for i, part in enumerate(parts):
        if isinstance(part, str) and ("[" in part or part in _TYPE_WORDS or part[:1].isupper()):
            continue  # a union member pydantic tried: list[...], str, literal[...], a model name
        if (isinstance(node, dict) and isinstance(part, str) and node.get("type") == part
                and i + 1 < len(parts) and (parts[i + 1] in node or parts[i + 1] == part)):
            continue  # the discriminator tag of a tagged union member
        out.append(part)
        if isinstance(node, dict) and isinstance(part, str):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None
    return tuple(out)


def param_name(path: tuple[int | str, ...]) -> str | None:
    """``("messages", 0, "content")`` → ``"messages[0].content"``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _errors(data: Any, err: ValidationError) -> list[tuple[tuple[int | str, ...], Any]]:
    """(path in the client's JSON, error), the most telling first: unknown fields (outermost
    first), then the deepest other error (the union member that matched the value's shape)."""
    found = [(_data_path(data, tuple(e["loc"])), e) for e in err.errors()]
    return sorted(found, key=lambda pe: (0, len(pe[0])) if pe[1]["type"] == "extra_forbidden" else (1, -len(pe[0])))


def _drop_unknown(data: Any, errors: list[tuple[tuple[int | str, ...], Any]]) -> bool:
    """Remove every field an ``extra_forbidden`` error names from ``data``; True if any was."""
    dropped = False
    for path, err in errors:
        if err["type"] != "extra_forbidden" or not path:
            continue
        node: Any = data
        for part in path[:-1]:
            node = node[part] if isinstance(node, dict | list) and _has(node, part) else None  # type: ignore[index]
        if isinstance(node, dict) and path[-1] in node:
            del node[path[-1]]
            dropped = True
    return dropped


def _has(node: dict[str, Any] | list[Any], part: int | str) -> bool:
    return part in node if isinstance(node, dict) else isinstance(part, int) and 0 <= part < len(node)


def _invalid(path: tuple[int | str, ...], first: Any) -> InvalidRequest:
    param = param_name(path)
    if first["type"] == "extra_forbidden":
        why = _WHY_REFUSED.get(str(path[-1]), "it is not a Chat Completions parameter tiergate accepts")
        return InvalidRequest(f"Unrecognized request argument supplied: '{param}' ({why})", param=param,
                              code="unsupported_parameter")
    if first["type"] == "missing":
        return InvalidRequest(f"missing required parameter: '{param}'", param=param,
                              code="missing_required_parameter")
    msg = str(first["msg"]).removeprefix("Value error, ")
    return InvalidRequest(f"invalid value for '{param}': {msg}", param=param, code="invalid_value")


def parse_chat_request(data: Any, unknown_fields: UnknownFields = "reject") -> ChatCompletionRequest:
    """Validate a decoded JSON body; raise ``InvalidRequest`` naming the first bad ``param``.
    ``unknown_fields="drop"``: undeclared fields are removed from ``data`` (in place) instead."""
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as err:
        errors = _errors(data, err)
        if unknown_fields == "drop" and _drop_unknown(data, errors):
            return parse_chat_request(data, unknown_fields)
        raise _invalid(*errors[0]) from None
