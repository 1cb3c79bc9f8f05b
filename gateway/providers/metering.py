"""Token metering for upstream calls: take usage from the upstream when it reports it, count it
with a tokenizer when it does not (streams cut short, upstreams that omit usage).

Counting uses tiktoken with the encoding files litellm bundles (found on disk without importing
litellm, which is slow to import; nothing is ever downloaded): o200k_base for the GPT-4o/4.1/5
and o-series families, cl100k_base for everything else — exact for OpenAI models, an estimate
for others. The local engine reports exact counts itself, so counting is only a fallback.
``warm_up`` loads the encodings off the event loop at start. Imports settings and
providers.base only.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson

from gateway.providers.base import Usage
from gateway.settings import ModelSettings

_O200K_FAMILIES = ("gpt-4o", "gpt-4.1", "gpt-5", "o1", "o3", "o4", "chatgpt-4o")
TOKENS_PER_MESSAGE = 3  # OpenAI's chat framing: <|start|>role ... <|end|>
REPLY_PRIMING_TOKENS = 3


def _bundled_tiktoken_dir() -> str | None:
    spec = importlib.util.find_spec("litellm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "litellm_core_utils" / "tokenizers"
        if path.is_dir():
            return str(path)
    return None


@lru_cache(maxsize=4)
def _encoding(name: str) -> Any:
    if "TIKTOKEN_CACHE_DIR" not in os.environ:
        bundled = _bundled_tiktoken_dir()
        if bundled:
            os.environ["TIKTOKEN_CACHE_DIR"] = bundled
    import tiktoken

    return tiktoken.get_encoding(name)


def encoding_name(model: ModelSettings) -> str:
    base = model.model.rsplit("/", 1)[-1].lower()
    return "o200k_base" if base.startswith(_O200K_FAMILIES) else "cl100k_base"


def warm_up(models: list[ModelSettings]) -> None:
    """Load the encodings the configured models need (call off the event loop)."""
    for name in {encoding_name(m) for m in models}:
        _encoding(name)


def count_text_tokens(model: ModelSettings, text: str) -> int:
    if not text:
        return 0
    return len(_encoding(encoding_name(model)).encode(text, disallowed_special=()))


def _message_text(message: dict[str, Any]) -> str:
    parts: list[str] = []
    for key, value in message.items():
        if isinstance(value, str):
            parts.append(value)
        elif key == "content" and isinstance(value, list):
            parts.extend(str(p.get("text") or "") for p in value if isinstance(p, dict))
        elif key == "tool_calls" and isinstance(value, list):
            parts.append(completion_text({"tool_calls": value}))
    return "".join(parts)


def count_prompt_tokens(model: ModelSettings, messages: list[dict[str, Any]]) -> int:
    """Prompt tokens as OpenAI counts them for chat: framing per message + every text field."""
    enc = _encoding(encoding_name(model))
    return REPLY_PRIMING_TOKENS + sum(
        TOKENS_PER_MESSAGE + len(enc.encode(_message_text(m), disallowed_special=())) for m in messages)


PER_MESSAGE_BOUND = 8  # role and framing tokens per message, above any tokenizer's
TOOLS_BOUND = 1024  # providers that describe tools in a system prompt of their own (Anthropic: ~350)


def prompt_token_bound(model: ModelSettings, body: dict[str, Any]) -> int:
    """At least as many tokens as any tokenizer makes of ``body``'s prompt, for budget holds that
    cannot be outrun: a byte-level BPE token covers at least one byte, so a prompt's UTF-8 size
    plus framing bounds its token count. Media parts (an image's tokens do not follow its bytes)
    and everything else bigger than the model's context window are bounded by that window: the
    upstream refuses longer prompts."""
    messages = body.get("messages") or []
    total = REPLY_PRIMING_TOKENS + PER_MESSAGE_BOUND * len(messages)
    for m in messages:
        for key, value in m.items():
            if key == "role":
                continue  # in the per-message framing
            if isinstance(value, str):
                total += len(value.encode("utf-8", "surrogatepass"))
            elif key == "content" and isinstance(value, list):
                for part in value:
                    if part.get("type") not in ("text", "refusal"):
                        return model.context_window
                    total += len(str(part.get("text") or part.get("refusal") or "").encode("utf-8", "surrogatepass"))
            elif value is not None:
                total += len(orjson.dumps(value))
    for key in ("tools", "functions", "response_format", "prediction"):
        if body.get(key) is not None:
            total += len(orjson.dumps(body[key])) + (TOOLS_BOUND if key in ("tools", "functions") else 0)
    return min(total, model.context_window)


def completion_text(message_or_delta: dict[str, Any]) -> str:
    """All generated text in a message/delta: content, reasoning, tool-call names and arguments."""
    parts: list[str] = []
    for key in ("content", "reasoning_content", "refusal"):
        value = message_or_delta.get(key)
        if isinstance(value, str):
            parts.append(value)
    for call in message_or_delta.get("tool_calls") or ():
        fn = call.get("function") or {}
        for key in ("name", "arguments"):
            if isinstance(fn.get(key), str):
                parts.append(fn[key])
    return "".join(parts)


def response_usage(model: ModelSettings, request_messages: list[dict[str, Any]],
                   response: dict[str, Any]) -> Usage:
    """Usage of a non-streamed response; counted when the upstream left it out."""
    if response.get("usage"):
        return Usage.from_openai(response["usage"])
    text = "".join(completion_text(c.get("message") or {}) for c in response.get("choices") or ())
    return Usage(prompt_tokens=count_prompt_tokens(model, request_messages),
                 completion_tokens=count_text_tokens(model, text))


class StreamMeter:
    """Watches the chunks of one streamed upstream call and knows what it cost so far."""

    def __init__(self, model: ModelSettings, request_messages: list[dict[str, Any]]) -> None:
        self._model = model
        self._messages = request_messages
        self._parts: list[str] = []
        self.reported: Usage | None = None

    def observe(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage"):
            self.reported = Usage.from_openai(chunk["usage"])
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            if delta:
                text = completion_text(delta)
                if text:
                    self._parts.append(text)

    @property
    def generated_text(self) -> str:
        return "".join(self._parts)

    def usage(self) -> Usage:
        """Reported usage if the upstream sent it, otherwise counted from what was streamed."""
        if self.reported is not None:
            return self.reported
        return Usage(prompt_tokens=count_prompt_tokens(self._model, self._messages),
                     completion_tokens=count_text_tokens(self._model, self.generated_text))
