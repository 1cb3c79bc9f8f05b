"""``OpenAICompatProvider.stream`` when the upstream connection breaks mid-stream: every complete
event aiohttp had already received is yielded (so the meter bills it) before the error, a line
the break cut off is dropped, and the connection is closed, not returned to the pool.

The response body is a real ``aiohttp.StreamReader`` fed by the test, so the break lands at an
exact point: aiohttp's readers raise a stored error ahead of the bytes still in the buffer, which
is the loss these tests pin down (it depends on event-loop timing over a real socket).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
import orjson
import pytest
from aiohttp.base_protocol import BaseProtocol

from gateway.errors import GatewayError, UpstreamError, UpstreamTimeout
from gateway.providers.openai_compat import OpenAICompatProvider
from gateway.settings import ModelSettings

MODEL = ModelSettings(provider="openai", model="upstream-a", api_base="http://upstream.invalid/v1", timeout_s=5)
BODY = {"messages": [{"role": "user", "content": "hi"}]}


def event(i: int) -> bytes:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f"w{i}"}}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


class FakeResponse:
    status = 200
    headers: dict[str, str] = {}

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self.content = content
        self.released = self.closed = False

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


class FakeSession:
    """The one call the provider makes on its session: ``await post(...)``."""

    closed = False

    def __init__(self, response: FakeResponse) -> None:
        self.response = response

    async def post(self, url: str, **_: Any) -> FakeResponse:
        return self.response


def body_reader() -> aiohttp.StreamReader:
    return aiohttp.StreamReader(BaseProtocol(asyncio.get_running_loop()), 2 ** 16)


def stream_over(content: aiohttp.StreamReader) -> tuple[AsyncIterator[dict[str, Any]], FakeResponse]:
    response = FakeResponse(content)
    session = cast(aiohttp.ClientSession, FakeSession(response))
    return OpenAICompatProvider(lambda: session).stream(MODEL, BODY), response


async def words_until_error(chunks: AsyncIterator[dict[str, Any]], seen: list[str]) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        async for chunk in chunks:
            seen.append(chunk["choices"][0]["delta"]["content"])
    return caught.value


@pytest.mark.parametrize(("broken", "raised"), [
    (aiohttp.ClientPayloadError("Response payload is not completed"), UpstreamError),
    (aiohttp.ServerTimeoutError("Timeout on reading data from socket"), UpstreamTimeout),
])
async def test_events_received_before_the_break_come_before_its_error(
        broken: Exception, raised: type[GatewayError]) -> None:
    content = body_reader()
    for i in range(6):
        content.feed_data(event(i))
    content.feed_data(event(6)[:20])  # cut off by the break: not an event
    content.set_exception(broken)  # stored before the first read: the readers would raise it first
    chunks, response = stream_over(content)
    seen: list[str] = []
    err = await words_until_error(chunks, seen)
    assert seen == [f"w{i}" for i in range(6)]
    assert type(err) is raised  # the connection error, not "invalid stream chunk" (not retryable)
    assert isinstance(err, UpstreamError) and err.retryable
    assert response.closed and not response.released


async def test_a_break_between_reads_loses_and_repeats_nothing() -> None:
    content = body_reader()
    content.feed_data(event(0) + event(1))
    chunks, response = stream_over(content)
    seen: list[str] = []
    first = await anext(chunks)
    seen.append(first["choices"][0]["delta"]["content"])
    for i in range(2, 5):
        content.feed_data(event(i))
    content.set_exception(aiohttp.ClientPayloadError("Response payload is not completed"))
    err = await words_until_error(chunks, seen)
    assert seen == ["w0", "w1", "w2", "w3", "w4"]
    assert isinstance(err, UpstreamError) and response.closed


async def test_a_whole_stream_still_ends_at_done_and_releases_the_connection() -> None:
    content = body_reader()
    content.feed_data(event(0) + b": keep-alive\n\n" + event(1) + b"data: [DONE]\n\n")
    content.feed_eof()
    chunks, response = stream_over(content)
    seen = [chunk["choices"][0]["delta"]["content"] async for chunk in chunks]
    assert seen == ["w0", "w1"] and response.released and not response.closed
