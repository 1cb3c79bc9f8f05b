"""The Anthropic Messages API's answers (the reply half of gateway.chat.anthropic): a Chat
Completions answer translated back — ``to_message`` for JSON, ``AnthropicStream`` for Anthropic's
server-sent events (``message_start``, ``content_block_*``, ``message_delta`` with the request's
ledger usage, ``message_stop``, ``ping``, ``error``) — and ``anthropic_error``, Anthropic's error
shape for any ``GatewayError``.

Imports the chat stream, metering and errors; no FastAPI.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import orjson

from gateway.chat.sse import ChatStream
from gateway.errors import GatewayError, UpstreamError
from gateway.ids import fast_id
from gateway.providers.base import Usage

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


__all__ = ["AnthropicStream", "anthropic_error", "anthropic_usage", "stop_reason", "to_message"]
