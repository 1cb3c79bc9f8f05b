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
tier, see ``effort_for_budget``). The answer is translated back by
gateway.chat.anthropic_reply (``to_message`` for JSON, ``AnthropicStream`` for Anthropic's
server-sent events, ``anthropic_error`` for Anthropic's error shape).

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

from typing import Annotated, Any, Literal

import orjson
from pydantic import Field

from gateway.chat.flow import ChatFlow, PrincipalLike
from gateway.errors import InvalidRequest
from gateway.ids import fast_id
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


__all__ = ["CountTokensRequest", "MessagesRequest", "count_input_tokens", "effort_for_budget", "new_message_id",
           "parse_count_tokens_request", "parse_messages_request", "to_chat_body"]
