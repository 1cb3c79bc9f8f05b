"""`tiergate engine serve` in a subprocess on a free loopback port, driven by the official
openai SDK: streaming (with include_usage and [DONE]), non-streaming, models, errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.gateway.tiny_local_model import write_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.integration]

MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("serve") / "tiny-moe")
    port = _free_port()
    cmd = [sys.executable, "-c", "from gateway.cli import main; main()", "engine", "serve",
           "--model", str(model_dir), "--port", str(port), "--threads", "1", "--context-window", "256"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode() if proc.stdout else ""
                pytest.fail(f"engine serve exited early:\n{out}")
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("engine serve did not come up")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def test_sdk_streams_with_usage_and_matches_non_streaming(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, temperature=0, max_tokens=10)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    stream = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, temperature=0, max_tokens=10,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 10


def test_raw_sse_ends_with_done_and_omits_usage_unless_asked(server: str) -> None:
    body = {"model": "tiny-moe", "messages": MESSAGES, "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all('"usage"' not in e for e in events)


def test_models_and_errors(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny-moe"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "x " * 400}])
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)

