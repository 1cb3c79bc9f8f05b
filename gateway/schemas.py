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

from typing import Annotated, Any, Literal, TypeVar

from annotated_types import Ge, Le
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

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


_MODEL_NAMES: set[str] = set()  # every wire model's class name (filled as they are declared)


def _integral(value: Any) -> Any:
    """JSON has one number type: 2.0 is the integer 2 (JSON Schema agrees); 2.5 stays a float and
    fails, and strings never become numbers."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


StopSequence = Annotated[str, Field(max_length=512)]
# Integers in their bounds (constraints inside the annotation, so the JSON schema carries them).
Int = Annotated[int, BeforeValidator(_integral)]
Choices = Annotated[int, Ge(1), Le(128), BeforeValidator(_integral)]
TokenCount = Annotated[int, Ge(1), Le(MAX_TOKENS_LIMIT), BeforeValidator(_integral)]
Seed = Annotated[int, Ge(-INT64), Le(INT64 - 1), BeforeValidator(_integral)]
TopLogprobs = Annotated[int, Ge(0), Le(20), BeforeValidator(_integral)]
TopK = Annotated[int, Ge(0), Le(100_000), BeforeValidator(_integral)]


class _Wire(BaseModel):
    """Strict: declared fields only, exact JSON types (ints are accepted where floats are)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _MODEL_NAMES.add(cls.__name__)  # union members' names are left out of error params


WireModel = _Wire  # the base of every wire allow-list (gateway.chat.anthropic declares Anthropic's)


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


class FunctionCall(_Wire):
    name: str = Field(..., max_length=64)
    arguments: str


class ToolCall(_Wire):
    id: str = Field(..., max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


TextContent = str | list[TextPart]


class _Named(_Wire):
    name: str | None = Field(None, max_length=256)


class SystemMessage(_Named):
    role: Literal["system"]
    content: TextContent


class DeveloperMessage(_Named):
    role: Literal["developer"]
    content: TextContent


UserPart = Annotated[TextPart | ImagePart | AudioPart | FilePart, Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class UserMessage(_Named):
    role: Literal["user"]
    content: str | list[UserPart]


class AssistantMessage(_Named):
    role: Literal["assistant"]
    content: str | list[AssistantPart] | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None


class ToolMessage(_Wire):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: str = Field(..., min_length=1, max_length=256)


class FunctionMessage(_Wire):
    role: Literal["function"]
    content: str | None
    name: str = Field(..., min_length=1, max_length=64)


Message = Annotated[SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage,
                    Field(discriminator="role")]


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
    # speculative decoding on the bundled engine (output-exact for greedy, distribution-preserving when
    # sampling): true = auto, false = off; other providers ignore it
    speculative: Literal["off", "auto", "prompt_lookup", "draft", "self"] | bool | None = None

    @property
    def speculative_mode(self) -> str | None:
        s = self.speculative
        return ("auto" if s else "off") if isinstance(s, bool) else s


# -- the request ------------------------------------------------------------------------------
class ChatCompletionRequest(_Wire):
    model: str = Field(..., min_length=1, max_length=256)
    messages: list[Message] = Field(..., min_length=1, max_length=4096)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: Choices | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    stop: StopSequence | Annotated[list[StopSequence], Field(max_length=4)] | None = None
    seed: Seed | None = None
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
    logit_bias: dict[str, Int] | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    # Sampling extensions that vLLM, SGLang and the bundled engine accept; forwarded only to
    # models that list them under ``extra_params`` in config.yaml.
    top_k: TopK | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    tiergate: TiergateOptions | None = None

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
        is_key = isinstance(node, dict) and part in node
        if isinstance(part, str) and not is_key and ("[" in part or part in _TYPE_WORDS or part in _MODEL_NAMES
                                                     or part.startswith("constrained-")):
            continue  # a union member pydantic tried: list[...], str, literal[...], a model's name
        if isinstance(node, dict) and isinstance(part, str) and i + 1 < len(parts) and (
                node.get("role") == part  # the message role a tagged union tried
                or (node.get("type") == part and (parts[i + 1] in node or parts[i + 1] == part))):
            continue  # the discriminator tag of a tagged union member (roles, content part types)
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
    found = [(_with_tag(_data_path(data, tuple(e["loc"])), e), e) for e in err.errors()]
    return sorted(found, key=lambda pe: (0, len(pe[0]), 0) if pe[1]["type"] == "extra_forbidden"
                  else (1, -len(pe[0]), pe[1]["type"].endswith("_type")))  # a wrong-type branch last


def _with_tag(path: tuple[int | str, ...], error: Any) -> tuple[int | str, ...]:
    """A union member that could not be chosen (``"role": "robot"``) is the tag field's fault."""
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        return (*path, str((error.get("ctx") or {}).get("discriminator", "")).strip("'"))
    return path


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


def _invalid(path: tuple[int | str, ...], first: Any, api: str = "Chat Completions") -> InvalidRequest:
    param = param_name(path)
    if first["type"] == "extra_forbidden":
        why = _WHY_REFUSED.get(str(path[-1]), f"it is not a {api} parameter tiergate accepts")
        return InvalidRequest(f"Unrecognized request argument supplied: '{param}' ({why})", param=param,
                              code="unsupported_parameter")
    if first["type"] == "missing":
        return InvalidRequest(f"missing required parameter: '{param}'", param=param,
                              code="missing_required_parameter")
    msg = str(first["msg"]).removeprefix("Value error, ")
    return InvalidRequest(f"invalid value for '{param}': {msg}", param=param, code="invalid_value")


W = TypeVar("W", bound=_Wire)


def parse_wire(model: type[W], data: Any, unknown_fields: UnknownFields = "reject", *,
               api: str = "Chat Completions") -> W:
    """Validate a decoded JSON body into ``model``; raise ``InvalidRequest`` naming the first bad
    ``param``. ``unknown_fields="drop"``: undeclared fields are removed from ``data`` (in place)
    instead. ``api`` names the API in the message refusing an unknown field."""
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        errors = _errors(data, err)
        if unknown_fields == "drop" and _drop_unknown(data, errors):
            return parse_wire(model, data, unknown_fields, api=api)
        raise _invalid(*errors[0], api=api) from None


def parse_chat_request(data: Any, unknown_fields: UnknownFields = "reject") -> ChatCompletionRequest:
    """Validate a decoded JSON body; raise ``InvalidRequest`` naming the first bad ``param``.
    ``unknown_fields="drop"``: undeclared fields are removed from ``data`` (in place) instead."""
    return parse_wire(ChatCompletionRequest, data, unknown_fields)
