"""The provider contract: every upstream (OpenAI-compatible HTTP, litellm, the in-process
engine) speaks OpenAI chat-completions dicts. Imports only settings and errors.

``complete`` returns an OpenAI ``chat.completion`` dict; ``stream`` yields
``chat.completion.chunk`` dicts (the last one carries ``usage`` when the upstream
reports it). Providers never choose their URL from the request body: the URL comes
from ``ModelSettings`` only.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.settings import ModelSettings

# The upstream connections a streamed answer has open, each as a function that drops it at once
# (synchronously). The HTTP layer sets a list for a stream whose server reports the client's
# hang-up in a callback (gateway.web.hangup) and calls them there; a provider that can drop its
# connection adds it while its stream is open. Unset (None): nobody calls them.
HANGUP_CLOSERS: ContextVar[list[Callable[[], None]] | None] = ContextVar("tiergate_hangup_closers", default=None)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_openai(cls, usage: dict[str, Any] | None) -> Usage:
        if not usage:
            return cls()
        prompt_details = usage.get("prompt_tokens_details") or {}
        completion_details = usage.get("completion_tokens_details") or {}
        return cls(
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            cached_tokens=int(prompt_details.get("cached_tokens") or 0),
            reasoning_tokens=int(completion_details.get("reasoning_tokens") or 0),
        )

    def to_openai(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens,
                     self.completion_tokens + other.completion_tokens,
                     self.cached_tokens + other.cached_tokens,
                     self.reasoning_tokens + other.reasoning_tokens)


CALL_ID_HEADER = "X-Client-Request-Id"  # OpenAI's name for a caller's own request id: the ledger row's id


@dataclass(frozen=True)
class CallOptions:
    """Per-call knobs the gateway sets: engine experts, timeouts; for the local engine the speculative
    mode (the tier's, or the client's validated ``tiergate.speculative``) and the prefix-cache salt (the
    tenant: one tenant's cached prompt blocks are never served to another)."""

    experts_per_token: int | None = None
    timeout_s: float | None = None
    speculative: str | None = None
    cache_salt: str | None = None
    trace_headers: tuple[tuple[str, str], ...] = ()  # W3C trace context for the upstream (gateway.telemetry.tracing)
    call_id: str | None = None  # the call's ledger row id, sent upstream as ``X-Client-Request-Id``

    def with_call_id(self, call_id: str | None) -> CallOptions:
        """A copy with ``call_id`` set (every journaled upstream attempt); ``self`` when None."""
        return self if call_id is None else self._with(call_id=call_id)

    def with_trace_headers(self, headers: tuple[tuple[str, str], ...]) -> CallOptions:
        """A copy with ``trace_headers`` set (every upstream attempt with tracing on)."""
        return self._with(trace_headers=headers)

    def with_call(self, call_id: str | None, headers: tuple[tuple[str, str], ...]) -> CallOptions:
        """``with_call_id(call_id).with_trace_headers(headers)`` in one copy."""
        if call_id is None:
            return self._with(trace_headers=headers)
        return self._with(call_id=call_id, trace_headers=headers)

    def _with(self, **changes: Any) -> CallOptions:
        """``replace(self, **changes)`` by copying the instance's dict, where ``dataclasses.replace``
        walks the fields in Python (~1 us, a quarter of an unsampled request's whole tracing cost)."""
        new = object.__new__(CallOptions)
        new.__dict__.update(self.__dict__, **changes)
        return new


class ChunkStream(Protocol):
    """An opened upstream stream of ``chat.completion.chunk`` dicts. ``aclose()`` (idempotent)
    stops it: on a stream that has not ended, the upstream connection is dropped so the upstream
    stops generating."""

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]: ...

    def __anext__(self) -> Awaitable[dict[str, Any]]: ...

    def aclose(self) -> Awaitable[None]: ...


class ChatProvider(Protocol):
    async def complete(self, model: ModelSettings, body: dict[str, Any],
                       options: CallOptions = ...) -> dict[str, Any]: ...

    def stream(self, model: ModelSettings, body: dict[str, Any],
               options: CallOptions = ...) -> AsyncGenerator[dict[str, Any], None]: ...

    async def aclose(self) -> None: ...
