"""``ChatStream``: the server-sent events of one streamed answer, as OpenAI sends them.

It holds the request's admitted stream (gateway.chat.admission) with its first chunk already
received, rewrites each chunk's ``id`` and ``model`` to the gateway's, replaces the upstream's
usage chunk by one covering every call of the request (when the client asked for usage), turns a
mid-stream upstream failure into OpenAI's error event, and records the request when it ends.
``close()`` must run however the response ends: on a stream that has not ended it cancels the
upstream, bills what was generated and records the request as cancelled.

Imports the chat flow's types and errors; no FastAPI.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson

from gateway.chat.admission import AdmittedStream
from gateway.chat.flow import STATUS_CLIENT_CLOSED, ChatFlow
from gateway.chat.request import ChatRequest
from gateway.chat.spend import RequestRows
from gateway.errors import GatewayError, ServiceUnavailable


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class ChatStream:
    def __init__(self, flow: ChatFlow, req: ChatRequest, rows: RequestRows, chunks: AdmittedStream,
                 first: dict[str, Any] | None) -> None:
        self.flow, self.req, self.rows, self.chunks = flow, req, rows, chunks
        self._first = first
        self.finished = False
        self._created = int(time.time())

    @property
    def headers(self) -> dict[str, str]:
        """The budget headers known when the stream opened (remaining after its hold)."""
        return self.chunks.admitted.headers

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for chunk in self.chunks:
            yield chunk

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        req, model = self.req, self.req.decision.requested_model
        try:
            async for chunk in self._chunks():
                if chunk.get("usage") and not chunk.get("choices"):
                    continue  # the upstream's usage chunk: replaced by ours below
                if req.include_usage:
                    chunk["usage"] = None
                else:
                    chunk.pop("usage", None)
                chunk["id"], chunk["model"] = req.request_id, model
                self._created = chunk.get("created") or self._created
                yield _sse(chunk)
        except GatewayError as err:  # mid-stream upstream failure: OpenAI sends an error event
            self.finished = True
            await self.chunks.aclose()  # settles the budgets to what was billed
            await self.flow.finish_failed(req, self.rows, "error", err.status, err.code)
            yield _sse(err.body())
            return
        await self.chunks.aclose()  # ended: settles the budgets to the request's rows
        if req.include_usage:
            yield _sse({"id": req.request_id, "object": "chat.completion.chunk", "created": self._created,
                        "model": model, "choices": [], "usage": self.rows.spend.usage.to_openai()})
        self.finished = True
        try:
            await self.flow.finish(req, self.rows, "ok", 200)
        except ServiceUnavailable as err:  # its rows could not be journaled: no [DONE], an error event
            yield _sse(err.body())
            return
        yield b"data: [DONE]\n\n"

    async def close(self) -> None:
        try:
            await self.chunks.aclose()  # no-op when the stream already ended; else cancels + bills
        finally:
            if not self.finished:
                self.finished = True
                await self.flow.finish(self.req, self.rows, "cancelled", STATUS_CLIENT_CLOSED,
                                       "client_closed_request")
            else:
                for entry in self.rows.take_parked():  # nothing is parked after finish; never drop one
                    self.flow.ledger.record(entry)
