"""Processes for `tiergate bench gateway`, run as ``python -m gateway.bench.tools <mock|load>``:

- ``mock``: a fast mock OpenAI upstream (aiohttp.web + uvloop) answering every chat completion
  with the same small JSON body (with usage), after ``--delay-ms`` when given;
- ``bare``: the floor for any Python gateway: a bare FastAPI + aiohttp pass-through (no auth, no
  ledger, no validation) under uvicorn with uvloop/httptools, one worker;
- ``sink``: an OTLP/HTTP trace receiver (aiohttp) that takes every export (``POST /v1/traces``,
  protobuf), answers it as a collector does (200, an empty ``ExportTraceServiceResponse``) and
  counts the requests, bytes and spans it got (``GET /stats``: JSON) — the far end of a traced
  gateway's real exporter, so its encoding and sending are measured too;
- ``load``: a small closed-loop HTTP/1.1 keep-alive load generator (asyncio streams + uvloop;
  lighter than an HTTP client library so it does not become the bottleneck). It POSTs one body
  with C connections for D seconds (or N requests) and prints JSON: requests, errors, rps,
  p50/p99 latency in ms.

Bench-only: the gateway never imports this module. Imports aiohttp, orjson, uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import orjson

RESPONSE = {"id": "chatcmpl-mock", "object": "chat.completion", "created": 1700000000, "model": "mock",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21,
                      "prompt_tokens_details": {"cached_tokens": 0},
                      "completion_tokens_details": {"reasoning_tokens": 0}}}


def run_mock(host: str, port: int, delay_ms: float = 0.0) -> None:
    from aiohttp import web

    body = orjson.dumps(RESPONSE)

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000)  # a fixed latency per call (`tiergate bench batches`)
        return web.Response(body=body, content_type="application/json")

    async def models(_: web.Request) -> web.Response:
        return web.Response(body=b'{"object":"list","data":[{"id":"mock","object":"model"}]}',
                            content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host=host, port=port, access_log=None, print=None)


def run_sink(host: str, port: int) -> None:
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    stats = {"requests": 0, "bytes": 0, "spans": 0}

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        stats["requests"] += 1
        stats["bytes"] += len(body)
        stats["spans"] += sum(len(ss.spans) for rs in export.resource_spans for ss in rs.scope_spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def get_stats(_: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(stats), content_type="application/json")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/stats", get_stats)
    web.run_app(app, host=host, port=port, access_log=None, print=None)


def run_bare(host: str, port: int, upstream: str) -> None:
    import aiohttp
    import uvicorn
    from fastapi import FastAPI, Request, Response

    state: dict[str, aiohttp.ClientSession] = {}
    app = FastAPI()

    async def chat(request: Request) -> Response:
        if "s" not in state:
            state["s"] = aiohttp.ClientSession()
        async with state["s"].post(upstream + "/chat/completions", data=await request.body(),
                                   headers={"Content-Type": "application/json"}) as resp:
            return Response(await resp.read(), status_code=resp.status, media_type="application/json")

    async def healthz(_: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    app.router.add_route("/v1/chat/completions", chat, methods=["POST"])  # Starlette routes, as tiergate's
    app.router.add_route("/healthz", healthz, methods=["GET"])

    uvicorn.run(app, host=host, port=port, loop="uvloop", http="httptools", access_log=False, log_level="warning")


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = None
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        lname = name.strip().lower()
        if lname == b"content-length":
            length = int(value)
        elif lname == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if length is not None:
        await reader.readexactly(length)
    elif chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return status


async def _worker(host: str, port: int, request: bytes, stop_at: float, budget: list[int],
                  lat: list[float], errors: list[int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < stop_at:
            if budget[0] <= 0:
                return
            budget[0] -= 1
            t0 = time.perf_counter()
            writer.write(request)
            try:
                status = await _read_response(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                errors[0] += 1
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                continue
            if status == 200:
                lat.append(time.perf_counter() - t0)
            else:
                errors[0] += 1
    finally:
        writer.close()


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def run_load(url: str, body: bytes, key: str, concurrency: int, duration_s: float,
                   max_requests: int, warmup: int) -> dict[str, Any]:
    from urllib.parse import urlsplit

    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    request = (f"POST {u.path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    if warmup:
        await _worker(host, port, request, time.perf_counter() + 30, [warmup], [], [0])
    lat: list[float] = []
    errors = [0]
    budget = [max_requests or 1 << 62]
    start = time.perf_counter()
    stop_at = start + duration_s
    await asyncio.gather(*(_worker(host, port, request, stop_at, budget, lat, errors)
                           for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    lat.sort()
    return {"requests": len(lat), "errors": errors[0], "seconds": round(elapsed, 3),
            "rps": round(len(lat) / elapsed, 1), "p50_ms": round(_percentile(lat, 0.50) * 1000, 3),
            "p99_ms": round(_percentile(lat, 0.99) * 1000, 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.tools")
    sub = parser.add_subparsers(dest="cmd", required=True)
    mock = sub.add_parser("mock")
    mock.add_argument("--host", default="127.0.0.1")
    mock.add_argument("--port", type=int, required=True)
    mock.add_argument("--delay-ms", type=float, default=0.0, help="answer each call after this long")
    sink = sub.add_parser("sink")
    sink.add_argument("--host", default="127.0.0.1")
    sink.add_argument("--port", type=int, required=True)
    bare = sub.add_parser("bare")
    bare.add_argument("--host", default="127.0.0.1")
    bare.add_argument("--port", type=int, required=True)
    bare.add_argument("--upstream", required=True)
    load = sub.add_parser("load")
    load.add_argument("--url", required=True)
    load.add_argument("--body", required=True, help="JSON request body")
    load.add_argument("--key", default="none")
    load.add_argument("--concurrency", type=int, default=1)
    load.add_argument("--duration", type=float, default=5.0)
    load.add_argument("--requests", type=int, default=0, help="stop after this many (0: by duration)")
    load.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args(argv)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover - uvloop is pinned
        pass
    if args.cmd == "mock":
        run_mock(args.host, args.port, args.delay_ms)
    elif args.cmd == "sink":
        run_sink(args.host, args.port)
    elif args.cmd == "bare":
        run_bare(args.host, args.port, args.upstream)
    else:
        result = asyncio.run(run_load(args.url, args.body.encode(), args.key, args.concurrency,
                                      args.duration, args.requests, args.warmup))
        sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
