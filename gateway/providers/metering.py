"""Token metering for upstream calls: take usage from the upstream when it reports it, count it
with the model's tokenizer when it does not (streams cut short, upstreams that omit usage).

Counting uses ``litellm.token_counter`` (tiktoken for OpenAI-style names, a default encoding
otherwise), imported lazily so nothing heavy loads at import time. The local engine reports
exact counts itself, so counting is only a fallback. Imports settings and providers.base only.
"""

from __future__ import annotations

import os
from typing import Any

from gateway.providers.base import Usage
from gateway.settings import ModelSettings


def _token_counter(model: ModelSettings, *, text: str | None = None,
                   messages: list[dict[str, Any]] | None = None) -> int:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    name = model.model if model.provider != "local" else "gpt-4o"
    if messages is not None:
        return int(litellm.token_counter(model=name, messages=messages))
    return int(litellm.token_counter(model=name, text=text or "", count_response_tokens=True))


def count_prompt_tokens(model: ModelSettings, messages: list[dict[str, Any]]) -> int:
    try:
        return _token_counter(model, messages=messages)
    except Exception:
        # Unusual content shapes (images, audio): fall back to a byte-based estimate rather than
        # billing zero. ~4 bytes per token is the usual BPE average.
        return sum(len(str(m.get("content") or "")) for m in messages) // 4 + 3 * len(messages)


def count_text_tokens(model: ModelSettings, text: str) -> int:
    if not text:
        return 0
    try:
        return _token_counter(model, text=text)
    except Exception:
        return max(1, len(text.encode()) // 4)


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
