"""Smoke tests for `tiergate bench gateway`'s parts (so the bench does not rot): the mock upstream
answers OpenAI-shaped JSON, the load generator counts requests, errors and percentiles, and the
report prints the ratios. No timing is asserted."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.bench.gateway import BenchArgs, Phase, _report
from gateway.bench.tools import run_load


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.integration
@pytest.mark.process
async def test_mock_and_load_generator() -> None:
    port = _port()
    mock = subprocess.Popen([sys.executable, "-m", "gateway.bench.tools", "mock", "--port", str(port)],
                            cwd=Path(__file__).resolve().parents[3])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and mock.poll() is None
                time.sleep(0.1)
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]})
        got = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=body).json()
        assert got["object"] == "chat.completion" and got["usage"]["total_tokens"] == 21
        r = await run_load(f"http://127.0.0.1:{port}/v1/chat/completions", body, "k", concurrency=4,
                           duration_s=30, max_requests=40, warmup=2)
        assert r["requests"] == 40 and r["errors"] == 0 and r["p50_ms"] <= r["p99_ms"]
        r = await run_load(f"http://127.0.0.1:{port}/nope", body, "k", concurrency=1, duration_s=30,
                           max_requests=3, warmup=0)
        assert (r["requests"], r["errors"]) == (0, 3)  # non-200 answers are errors, not latencies
    finally:
        mock.terminate()
        mock.wait(10)


def test_report_prints_ratios() -> None:
    results = {"direct": (Phase(1000, 1.0, 2.0, 0), Phase(1000, 1.0, 2.0, 0)),
               "tiergate": (Phase(500, 2.0, 4.0, 0), Phase(400, 2.0, 4.0, 0)),
               "litellm": (Phase(50, 11.0, 20.0, 0), Phase(20, 11.0, 20.0, 0))}
    out = _report(results, ["a note"], BenchArgs(), 2)
    assert "tiergate / LiteLLM RPS: 20.00x" in out
    assert "tiergate added p50 / LiteLLM added p50: 0.100" in out
    assert "note: a note" in out
