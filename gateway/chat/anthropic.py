"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a second
ingress to the same chat flow.

``MessagesRequest`` is the allow-list, strict like gateway.schemas: every field a client may send
is declared with its type and bounds, and anything else — at any depth — is a 400 naming it.
``to_chat_body`` translates the validated request into a Chat Completions body, which then goes
through the OpenAI allow-list, ``decide``, admission, the executors, the budgets and the ledger
exactly as a ``/v1/chat/completions`` request does (``ChatFlow.prepare``): ``system`` becomes a
system message, ``tool_use`` / ``tool_result`` blocks become ``tool_calls`` / ``tool`` messages,
``tools`` / ``tool_choice`` become functions, ``stop_sequences`` become ``stop``, and
``thinking.budget_tokens`` becomes ``reasoning_effort`` (which routes ``model: "auto"`` to a
tier, see ``effort_for_budget``). The answer is translated back: ``to_message`` for JSON, and
``AnthropicStream`` for Anthropic's server-sent events (``message_start``, ``content_block_*``,
``message_delta``, ``message_stop``, ``ping``, ``error``), whose ``message_delta`` usage is the
sum of the request's ledger rows. ``anthropic_error`` is Anthropic's error shape for any
``GatewayError``.

Usage follows Anthropic's meaning: ``input_tokens`` excludes prompt tokens read from a cache,
which are ``cache_read_input_tokens`` (their sum is the ledger's prompt tokens). OpenAI-style
upstreams do not say which stop sequence ended a reply, so ``stop_sequence`` is always null and a
stop is ``end_turn``.

Refused on purpose: server tools (web search, code execution…), documents, citations, images in
tool results, ``mcp_servers`` and ``container`` — things tiergate does not price or cannot
forward to an OpenAI-compatible upstream. ``cache_control`` markers are accepted and dropped.

Imports the chat flow, routing, schemas, metering and errors; no FastAPI.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field

from gateway.chat.flow import ChatFlow, PrincipalLike
from gateway.chat.sse import ChatStream
from gateway.errors import GatewayError, InvalidRequest, UpstreamError
from gateway.ids import fast_id
from gateway.providers.base import Usage
from gateway.providers.metering import count_prompt_tokens
from gateway.routing import decide
from gateway.schemas import (
    Effort,
    StopSequence,
    TiergateOptions,
    TokenCount,
    TopK,
    UnknownFields,
    WireModel,
    parse_chat_request,
    parse_wire,
)

API = "Anthropic Messages"
THINKING_MIN_BUDGET = 1024  # Anthropic's own lower bound


# -- the request allow-list -------------------------------------------------------------------
class CacheControl(WireModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(WireModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class Base64Source(WireModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(..., min_length=1)


class URLSource(WireModel):
    type: Literal["url"]
    url: str = Field(..., min_length=1, max_length=8192)


class ImageBlock(WireModel):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None


class ToolUseBlock(WireModel):
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1, max_length=256)
    name: str = Field(..., min_length=1, max_length=64)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(WireModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(WireModel):
    """A previous turn's thinking, sent back by clients that keep the whole reply: accepted,
    not forwarded (OpenAI-compatible upstreams take no reasoning in their input)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(WireModel):
    type: Literal["redacted_thinking"]
    data: str


UserBlock = Annotated[TextBlock | ImageBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock,
                           Field(discriminator="type")]


class UserMessage(WireModel):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantMessage(WireModel):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


Message = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class ToolDef(WireModel):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoiceAuto(WireModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(WireModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(WireModel):
    type: Literal["tool"]
    name: str = Field(..., min_length=1, max_length=64)
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(WireModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(WireModel):
    type: Literal["enabled"]
    budget_tokens: Annotated[TokenCount, Field(ge=THINKING_MIN_BUDGET)]


class ThinkingDisabled(WireModel):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled, Field(discriminator="type")]


class Metadata(WireModel):
    user_id: str | None = Field(None, max_length=512)


class _Prompt(WireModel):
    """What a Messages request and a token count share."""

    model: str = Field(..., min_length=1, max_length=256)
    messages: list[Message] = Field(..., min_length=1, max_length=4096)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class CountTokensRequest(_Prompt):
    pass


class MessagesRequest(_Prompt):
    max_tokens: TokenCount
    stream: bool = False
    stop_sequences: Annotated[list[StopSequence], Field(max_length=4)] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: TopK | None = None
    metadata: Metadata | None = None
    tiergate: TiergateOptions | None = None

    @property
    def thinking_enabled(self) -> bool:
        return isinstance(self.thinking, ThinkingEnabled)


def parse_messages_request(data: Any, unknown_fields: UnknownFields = "reject") -> MessagesRequest:
    return parse_wire(MessagesRequest, data, unknown_fields, api=API)


def parse_count_tokens_request(data: Any, unknown_fields: UnknownFields = "reject") -> CountTokensRequest:
    return parse_wire(CountTokensRequest, data, unknown_fields, api=API)


# -- Anthropic -> Chat Completions ------------------------------------------------------------
def effort_for_budget(budget_tokens: int) -> Effort:
    """``thinking.budget_tokens`` as an effort: under 4k tokens ``low``, under 16k ``medium``,
    under 32k ``high``, else ``xhigh`` (Anthropic's own guidance calls 1-4k light, 16k+ deep)."""
    if budget_tokens < 4096:
        return "low"
    if budget_tokens < 16384:
        return "medium"
    if budget_tokens < 32768:
        return "high"
    return "xhigh"


def _text(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "".join(b.text for b in blocks)


def _user(msg: UserMessage) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages (they answer the previous assistant
    turn's calls, so they come first), then the rest as one user message."""
    if isinstance(msg.content, str):
        return [{"role": "user", "content": msg.content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in msg.content:
        if isinstance(block, ToolResultBlock):
            text = _text(block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"[tool error] {text}" if block.is_error else text})
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        else:
            src = block.source
            url = f"data:{src.media_type};base64,{src.data}" if isinstance(src, Base64Source) else src.url
            parts.append({"type": "image_url", "image_url": {"url": url}})
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant(msg: AssistantMessage) -> dict[str, Any]:
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    text = "".join(b.text for b in msg.content if isinstance(b, TextBlock))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": orjson.dumps(b.input).decode()}}
             for b in msg.content if isinstance(b, ToolUseBlock)]
    out: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        out["tool_calls"] = calls
    return out


def _messages(req: _Prompt) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system)})
    for msg in req.messages:
        if isinstance(msg, UserMessage):
            out.extend(_user(msg))
        else:
            out.append(_assistant(msg))
    if not out:
        raise InvalidRequest("messages: every user turn is empty", param="messages")
    return out


def _tools(req: _Prompt, body: dict[str, Any]) -> None:
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description is not None else {}),
            "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is None:
        return
    if isinstance(choice, ToolChoiceNone):
        body["tool_choice"] = "none"
        return
    if isinstance(choice, ToolChoiceTool):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = "auto" if isinstance(choice, ToolChoiceAuto) else "required"
    if choice.disable_parallel_tool_use is not None and req.tools:
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use


def _prompt_body(req: _Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req)}
    _tools(req, body)
    if isinstance(req.thinking, ThinkingEnabled):
        body["reasoning_effort"] = effort_for_budget(req.thinking.budget_tokens)
    return body


def to_chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The Chat Completions body for ``req`` (plain JSON, validated again by ``ChatFlow.prepare``)."""
    body = _prompt_body(req)
    body["max_tokens"] = req.max_tokens
    if req.stream:
        body["stream"], body["stream_options"] = True, {"include_usage": True}
    if req.stop_sequences:
        body["stop"] = list(req.stop_sequences)
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.metadata is not None and req.metadata.user_id is not None:
        body["user"] = req.metadata.user_id
    if req.tiergate is not None:
        body["tiergate"] = req.tiergate.model_dump(exclude_unset=True)
    return body


def new_message_id() -> str:
    return "msg_" + fast_id()


def count_input_tokens(flow: ChatFlow, principal: PrincipalLike, req: CountTokensRequest) -> int:
    """The prompt's tokens with the tokenizer of the model the request would be routed to first
    (the tools' definitions counted as one more message)."""
    body = parse_chat_request(_prompt_body(req)).forwardable()
    decision = decide(flow.settings, req.model, body, reasoning_effort=body.get("reasoning_effort"),
                      decide_auto=flow.decide_auto, tenant=principal.tenant_id, prefs=principal.routing)
    messages = list(body["messages"])
    if body.get("tools"):
        messages.append({"role": "system", "content": orjson.dumps(body["tools"]).decode()})
    return count_prompt_tokens(flow.settings.models[decision.models[0]], messages)


# -- Chat Completions -> Anthropic ------------------------------------------------------------
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                 "content_filter": "refusal"}


def stop_reason(finish_reason: str | None) -> str:
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn")


def anthropic_usage(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def _tool_input(arguments: str | None) -> dict[str, Any]:
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise UpstreamError("the upstream model's tool call arguments are not a JSON object", retryable=False)
    return value


def to_message(response: dict[str, Any], message_id: str, model: str, usage: Usage,
               thinking: bool) -> dict[str, Any]:
    """An Anthropic ``message`` from a Chat Completions answer; ``usage``: the request's ledger sum."""
    choice = (response.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if thinking and msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or "toolu_" + fast_id(), "name": fn.get("name", ""),
                        "input": _tool_input(fn.get("arguments"))})
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(choice.get("finish_reason")), "stop_sequence": None,
            "usage": anthropic_usage(usage)}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                499: "invalid_request_error", 504: "timeout_error", 529: "overloaded_error"}


def anthropic_error(err: GatewayError) -> dict[str, Any]:
    """Anthropic's error body for ``err`` (its status stays the HTTP status)."""
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class _Blocks:
    """Turns Chat Completions deltas (choice 0) into content-block events, one block open at a time."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool:<n>"
        self.tool_id: str | None = None  # the open tool_use block's id

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def feed(self, delta: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        reasoning = delta.get("reasoning_content")
        if self.thinking and reasoning:
            if self.open != "thinking":
                out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        text = delta.get("content")
        if text:
            if self.open != "text":
                out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or []:
            kind = f"tool:{call.get('index', 0)}"
            fn = call.get("function") or {}
            call_id = call.get("id")
            if self.open != kind or (call_id and call_id != self.tool_id):  # a new call (some repeat the id)
                self.tool_id = call_id or "toolu_" + fast_id()
                out += self._start(kind, {"type": "tool_use", "id": self.tool_id, "name": fn.get("name") or "",
                                          "input": {}})
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out


class AnthropicStream(ChatStream):
    """The request's chunks as Anthropic's events; records and settles exactly as ``ChatStream``
    does (``close()`` is inherited). ``message_delta`` carries the request's ledger usage."""

    def __init__(self, opened: ChatStream, thinking: bool) -> None:
        super().__init__(opened.flow, opened.req, opened.rows, opened.chunks, opened._first)
        self.thinking = thinking

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        req = self.req
        yield _event("message_start", {"type": "message_start", "message": {
            "id": req.request_id, "type": "message", "role": "assistant", "model": req.decision.requested_model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}})
        yield _event("ping", {"type": "ping"})
        blocks = _Blocks(self.thinking)
        finish: str | None = None
        try:
            async for chunk in self._chunks():
                for choice in chunk.get("choices") or ():
                    if choice.get("index", 0) != 0:
                        continue
                    for event in blocks.feed(choice.get("delta") or {}):
                        yield event
                    finish = choice.get("finish_reason") or finish
        except GatewayError as err:  # mid-stream upstream failure: Anthropic sends an error event
            self.finished = True
            await self.chunks.aclose()  # settles the budgets to what was billed
            await self.flow.finish(req, self.rows, "error", err.status, err.code)
            yield _event("error", anthropic_error(err))
            return
        await self.chunks.aclose()  # ended: settles the budgets to the request's rows
        for event in blocks.close():
            yield event
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": stop_reason(finish), "stop_sequence": None},
                                       "usage": anthropic_usage(self.rows.spend.usage)})
        self.finished = True
        await self.flow.finish(req, self.rows, "ok", 200)
        yield _event("message_stop", {"type": "message_stop"})


__all__ = ["AnthropicStream", "CountTokensRequest", "MessagesRequest", "anthropic_error", "count_input_tokens",
           "effort_for_budget", "new_message_id", "parse_count_tokens_request", "parse_messages_request",
           "to_chat_body", "to_message"]
