"""Streaming a pipeline request as OpenAI ``chat.completion.chunk`` dicts: a role chunk, stage
progress as ``delta.reasoning_content`` while the stages run, the final answer as ordinary
``delta.content``, a finish chunk carrying the ``tiergate`` extension object, and (with
``stream_options.include_usage``) a usage chunk covering every stage.

If the consumer stops early (client gone), the running pipeline task is cancelled.
Imports pipeline result/types only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from gateway.pipeline.result import PipelineResult
from gateway.pipeline.types import ProgressSink

ANSWER_CHUNK_CHARS = 48
_DONE = object()


class PipelineStream:
    """Async iterator of chunk dicts; ``result`` is set once it is exhausted."""

    def __init__(self, run: Callable[[ProgressSink, Callable[[], None]], Coroutine[Any, Any, PipelineResult]], *,
                 request_id: str,
                 model: str, created: int, include_usage: bool) -> None:
        self._run, self.request_id, self.model, self.created = run, request_id, model, created
        self.include_usage = include_usage
        self.result: PipelineResult | None = None

    def chunk(self, delta: dict[str, Any] | None, finish_reason: str | None = None,
              **extra: Any) -> dict[str, Any]:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason}]
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def __aiter__(self) -> AsyncGenerator[dict[str, Any], None]:
        return self._chunks()

    async def _chunks(self) -> AsyncGenerator[dict[str, Any], None]:
        queue: asyncio.Queue[object] = asyncio.Queue()
        admitted = asyncio.Event()
        task: asyncio.Task[PipelineResult] = asyncio.create_task(
            self._run(lambda line: queue.put_nowait(line + "\n"), admitted.set))
        task.add_done_callback(lambda _: queue.put_nowait(_DONE))
        try:
            # Nothing is sent until the first stage call is admitted by the budgets: a refusal
            # (or any failure) before that raises here, ahead of the first byte of the response.
            waiter = asyncio.ensure_future(admitted.wait())
            try:
                await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            if task.done() and not admitted.is_set():
                task.result()  # raises what stopped the pipeline before it was admitted
            yield self.chunk({"role": "assistant", "content": ""})
            while (item := await queue.get()) is not _DONE:
                yield self.chunk({"reasoning_content": item})
            result = await task
            self.result = result
            text = result.answer
            for start in range(0, len(text), ANSWER_CHUNK_CHARS):
                yield self.chunk({"content": text[start:start + ANSWER_CHUNK_CHARS]})
            yield self.chunk({}, "stop", tiergate=result.tiergate_object())
            if self.include_usage:
                yield self.chunk(None, usage=result.usage.to_openai())
        finally:
            if not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
