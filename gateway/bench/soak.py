"""`tiergate bench soak --minutes N`: a long run of mixed traffic against `tiergate serve`, watched
for leaks and lag, ending with the money invariant.

A counting mock upstream runs in this process (aiohttp, its own thread: JSON answers and SSE
streams, ``--upstream-ms`` of latency each). `tiergate serve` runs in a subprocess (SQLite, the
journaled ledger, one worker, a budget on the tenant, the embedded batch runner). First the
gateway's closed-loop max RPS is measured (the same mix, 16 connections, 5 s); then an
open-loop load at ``--load`` (0.7) of it runs for N minutes: 55% non-streamed, 25% streamed, 10%
streams the client cuts after the first chunk, 10% forced through the pipeline, and one 5-line
batch per sample interval. Every ``--sample-s`` seconds a line: the server's RSS and open fds
(from /proc), the p99 of a /healthz round trip sampled every 100 ms (a proxy for event-loop lag:
/healthz answers on the loop without I/O), the ledger's rows waiting for the database
(/readyz ``ledger_state.pending_db``), and the requests done / failed. At the end, after the
batches finish and the ledger drains: ledger rows matched to the calls the mock received by id (each call
carries its row id as `X-Client-Request-Id`), the budget's
spent vs the ledger's sum, and RSS / fd growth after warm-up (the first 20% of the run): RSS and
open fds are also read every second, and growth is the median of the last quarter of those
readings against the median of the first quarter after warm-up — a trend, not two points, since
the fd count moves ±20% with the sockets in flight at the instant it is read (the point-to-point
figure and the range are printed beside it). Numbers on a shared, busy machine are noisy: compare
runs on one machine.

Bench-only: imported lazily by gateway.cli.bench.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import yaml

from gateway.bench.ledger_match import ledger_rows, match_rows
from gateway.bench.proc_growth import Reading, growth, proc_stats
from gateway.providers.base import CALL_ID_HEADER

ADMIN_KEY = "soak-admin-key"
MSGS = [{"role": "user", "content": "Say hello"}]
WORDS = 8


@dataclass(frozen=True)
class SoakArgs:
    minutes: float = 20.0
    sample_s: float = 30.0
    load: float = 0.7
    probe_concurrency: int = 16
    upstream_ms: float = 20.0
    seed: int = 7


@dataclass
class Sample:
    t_s: float
    rss_kib: int
    fds: int
    healthz_p99_ms: float
    pending_db: int
    done: int
    failed: int


@dataclass
class _Counts:
    done: int = 0
    failed: int = 0
    cut: int = 0
    batches: list[str] = field(default_factory=list)


class CountingUpstream:
    """An OpenAI-compatible mock that counts every call it receives."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.calls = 0
        self.ids: dict[str | None, int] = {}  # X-Client-Request-Id (the call's ledger row id) -> times seen
        self.stopped = 0  # streams the gateway closed before their last line (e.g. its client cut them)
        self.lock = threading.Lock()
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="soak-upstream", daemon=True)

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("mock upstream did not start")
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        from aiohttp import web

        async def chat(request: web.Request) -> web.StreamResponse:
            with self.lock:  # counted as it arrives, before its body is read (the gateway may cut it)
                self.calls += 1
                call_id = request.headers.get(CALL_ID_HEADER)
                self.ids[call_id] = self.ids.get(call_id, 0) + 1
            body = await request.json()
            n = min(int(body.get("max_tokens") or WORDS), WORDS)
            usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
            await asyncio.sleep(self.latency_s)
            if not body.get("stream"):
                return web.json_response({
                    "id": "x", "object": "chat.completion", "created": 0, "model": body.get("model"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(["w"] * n)},
                                 "finish_reason": "stop"}], "usage": usage})
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for i in range(n):
                    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body.get("model"),
                             "choices": [{"index": 0, "delta": {"content": "w "}, "finish_reason": None}]}
                    await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                    await asyncio.sleep(self.latency_s / WORDS if i else 0)
                if (body.get("stream_options") or {}).get("include_usage"):
                    last = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body.get("model"),
                            "choices": [], "usage": usage}
                    await resp.write(b"data: " + orjson.dumps(last) + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
            except ConnectionResetError:  # the gateway stopped the call (its client cut the stream): expected
                with self.lock:
                    self.stopped += 1
            return resp

        async def serve() -> None:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", chat)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
            await web.SockSite(runner, sock).start()
            self._ready.set()
            await asyncio.Event().wait()

        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(serve())


def _config(work: Path, upstream: str) -> Path:
    model = {"provider": "openai", "model": "mock", "api_base": upstream, "context_window": 8192,
             "max_retries": 0, "price": {"input": 0.5, "output": 1.5}}
    cfg = {"server": {"log_level": "warning"},
           "database": {"url_env": "TIERGATE_SOAK_DATABASE_URL", "default_url": "sqlite:///tiergate-soak.db"},
           "ledger": {"journal_dir": "journal"},
           "models": {"mock": model},
           "tiers": {t: {"model": "mock", "max_output_tokens": 64}
                     for t in ("none", "minimal", "low", "medium", "high", "xhigh")},
           "jobs": {"poll_interval_s": 0.2}}
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _tenant(config: Path) -> tuple[str, str]:
    """(tenant id, API key) in the soak's database, with a budget large enough never to refuse."""
    from gateway.auth import generate_key, hash_key
    from gateway.budgets.policies import put_policy
    from gateway.db import migrate
    from gateway.db.queries import add_api_key, create_tenant
    from gateway.db.session import database_url, make_engine, make_session_factory
    from gateway.settings import load_settings

    url = database_url(load_settings(config))
    migrate.upgrade(url.render_as_string(hide_password=False))
    engine = make_engine(url)
    raw = generate_key()
    with make_session_factory(engine)() as s, s.begin():
        tenant = create_tenant(s, "soak")
        add_api_key(s, tenant.id, raw, hash_key(raw))
        put_policy(s, scope="tenant", tenant_id=tenant.id, period="month", limit_usd=Decimal(1000))
        tenant_id = tenant.id
    engine.dispose()
    return tenant_id, raw


def _p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# The load is generated with aiohttp: httpx's connection pool costs the client CPU that grows
# with the connections open (a soak at a few hundred requests in flight saturated a core with
# the client alone, and a slowed client holds more connections open: the server's fd count then
# measures the client).
ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


async def _one(client: aiohttp.ClientSession, kind: str, counts: _Counts) -> None:
    body: dict[str, Any] = {"model": "low", "messages": MSGS, "max_tokens": WORDS}
    try:
        if kind in ("json", "pipeline"):
            payload = body if kind == "json" else {**body, "tiergate": {"pipeline": "on"}}
            async with client.post("/v1/chat/completions", json=payload) as r:
                await r.read()
                ok = r.status == 200
        else:
            async with client.post("/v1/chat/completions", json={**body, "stream": True}) as r:
                ok = r.status == 200
                async for _ in r.content:  # one SSE line at a time
                    if kind == "cut":
                        counts.cut += 1
                        r.close()  # drop the connection mid-stream
                        break
    except ERRORS:
        ok = False
    if ok:
        counts.done += 1
    else:
        counts.failed += 1


async def _batch(client: aiohttp.ClientSession, counts: _Counts) -> None:
    lines = [orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "low", "messages": MSGS, "max_tokens": WORDS}}) for i in range(5)]
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", b"\n".join(lines), filename="soak.jsonl", content_type="application/jsonl")
    try:
        async with client.post("/v1/files", data=form) as f:
            file_id = (await f.json())["id"]
        async with client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                    "completion_window": "24h"}) as r:
            if r.status == 200:
                counts.batches.append((await r.json())["id"])
            else:
                counts.failed += 1
    except (*ERRORS, KeyError):
        counts.failed += 1


def _session(base: str, key: str, connections: int, timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(base_url=base, headers={"Authorization": f"Bearer {key}"},
                                 connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


def _kind(rng: random.Random) -> str:
    """The soak's traffic mix: 55% JSON, 25% streams, 10% streams the client cuts, 10% pipeline."""
    u = rng.random()
    return "json" if u < 0.55 else "stream" if u < 0.80 else "cut" if u < 0.90 else "pipeline"


async def _probe(base: str, key: str, concurrency: int, seconds: float, seed: int) -> float:
    """Closed-loop max RPS of the soak's own mix (batches aside)."""
    rng = random.Random(seed)
    counts = _Counts()
    stop = time.monotonic() + seconds

    async def worker(client: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop:
            await _one(client, _kind(rng), counts)

    async with _session(base, key, concurrency, 30) as client:
        start = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return counts.done / (time.monotonic() - start)


async def _soak(base: str, key: str, pid: int, rate: float, args: SoakArgs,
                out: list[str]) -> tuple[list[Sample], list[Reading], _Counts]:
    rng = random.Random(args.seed)
    counts = _Counts()
    samples: list[Sample] = []
    readings: list[Reading] = []
    health: list[float] = []
    duration = args.minutes * 60
    start = time.monotonic()
    pending: set[asyncio.Task[None]] = set()
    async with _session(base, key, 256, 60) as client, httpx.AsyncClient(base_url=base, timeout=10) as probe:

        async def watch_health() -> None:
            read_at = start
            while time.monotonic() - start < duration:
                if time.monotonic() >= read_at:
                    read_at += 1.0
                    rss, fds = proc_stats(pid)
                    readings.append(Reading(time.monotonic() - start, rss, fds))
                t0 = time.perf_counter()
                try:
                    await probe.get("/healthz")
                    health.append((time.perf_counter() - t0) * 1000)
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)

        async def sample() -> None:
            next_at = start + args.sample_s
            while True:
                await asyncio.sleep(max(next_at - time.monotonic(), 0))
                next_at += args.sample_s
                rss, fds = proc_stats(pid)
                ready = (await probe.get("/readyz")).json()
                s = Sample(time.monotonic() - start, rss, fds, _p99(health), ready["ledger_state"]["pending_db"],
                           counts.done, counts.failed)
                health.clear()
                samples.append(s)
                line = (f"  t={s.t_s:6.0f}s rss={s.rss_kib / 1024:7.1f} MiB fds={s.fds:4d} "
                        f"healthz_p99={s.healthz_p99_ms:6.1f} ms ledger_pending={s.pending_db:5d} "
                        f"done={s.done} failed={s.failed}")
                out.append(line)
                sys.stderr.write(line + "\n")
                await _batch(client, counts)
                if s.t_s >= duration:
                    return

        sampler = asyncio.create_task(sample())
        watcher = asyncio.create_task(watch_health())
        interval = 1.0 / rate
        next_at = time.monotonic()
        while time.monotonic() - start < duration:
            task = asyncio.create_task(_one(client, _kind(rng), counts))
            pending.add(task)
            task.add_done_callback(pending.discard)
            next_at += rng.expovariate(1.0 / interval)
            await asyncio.sleep(max(next_at - time.monotonic(), 0))
        await asyncio.gather(*pending)
        await watcher
        await sampler
        for batch_id in counts.batches:  # every batch to its end
            for _ in range(600):
                async with client.get(f"/v1/batches/{batch_id}") as r:
                    b = await r.json()
                if b["status"] in ("completed", "failed", "cancelled", "expired"):
                    break
                await asyncio.sleep(0.2)
    return samples, readings, counts


def run_soak(args: SoakArgs) -> str:
    from gateway.bench.gateway import _free_port, _process

    upstream = CountingUpstream(args.upstream_ms / 1000)
    upstream_url = upstream.start()
    with tempfile.TemporaryDirectory(prefix="tiergate-soak-") as tmp:
        work = Path(tmp)
        config = _config(work, upstream_url)
        tenant_id, key = _tenant(config)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        env = {**os.environ, "TIERGATE_ADMIN_KEY": ADMIN_KEY, "TIERGATE_CONFIG": str(config)}
        cmd = [sys.executable, "-c", "from gateway.cli import main; main()", "serve", "--config", str(config),
               "--port", str(port)]
        out = [f"tiergate bench soak: {args.minutes:g} min, samples every {args.sample_s:g} s, upstream "
               f"{args.upstream_ms:g} ms (numbers taken on a shared, busy machine: noisy)"]
        with _process(cmd, base + "/readyz", work / "serve.log", env=env):
            pid = _serve_pid(port)
            max_rps = asyncio.run(_probe(base, key, args.probe_concurrency, 5.0, args.seed + 1))
            rate = max(args.load * max_rps, 1.0)
            out.append(f"  max RPS (the mix below, {args.probe_concurrency} connections): {max_rps:.1f}; "
                       f"soak at {args.load:.0%} = {rate:.1f} req/s (55% JSON, 25% streams, 10% cut streams, "
                       "10% pipeline, a 5-line batch per sample)")
            samples, readings, counts = asyncio.run(_soak(base, key, pid, rate, args, out))
            for _ in range(300):  # the ledger drains (60 s at most)
                with upstream.lock:
                    ids = dict(upstream.ids)
                check = match_rows(ids, ledger_rows(config))
                if check.lost == 0:
                    break
                time.sleep(0.2)
            status = httpx.get(f"{base}/admin/budgets/tenants/{tenant_id}",
                               headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).json()["status"]
        spent = Decimal(str(status["spent_usd"]))
        rss, fds = growth(readings, "rss_kib", args.minutes), growth(readings, "fds", args.minutes)
        lag = [s.healthz_p99_ms for s in samples if s.healthz_p99_ms == s.healthz_p99_ms]
        ok = check.ok and spent == check.total
        out += [f"  requests: {counts.done} done, {counts.failed} failed, {counts.cut} cut by the client, "
                f"{len(counts.batches)} batches; {upstream.stopped} upstream streams closed by the gateway before the mock wrote their last line",
                f"  after warm-up ({fds.readings} readings, one a second; growth = median of the last quarter vs "
                "the first):",
                f"    RSS growth {rss.trend:+.1f}% (first vs last reading {rss.endpoints:+.1f}%; range "
                f"{rss.low / 1024:.1f}-{rss.high / 1024:.1f} MiB)",
                f"    fd growth {fds.trend:+.1f}% (first vs last reading {fds.endpoints:+.1f}%; range "
                f"{fds.low}-{fds.high})",
                f"  healthz p99 median over samples {statistics.median(lag) if lag else float('nan'):.1f} ms",
                f"  invariant: {check.line()}; budget spent ${spent} vs ledger sum ${check.total} -> "
                f"{'OK' if ok else 'BROKEN'}"]
    return "\n".join(out)


def _serve_pid(port: int) -> int:
    """The pid of the process listening on ``port`` (the `tiergate serve` just started)."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inode = parts[9]
    if inode is None:
        raise RuntimeError(f"nothing listens on port {port}")
    target = f"socket:[{inode}]"
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:
            continue
    raise RuntimeError(f"no process holds the socket on port {port}")


if __name__ == "__main__":  # pragma: no cover
    print(run_soak(SoakArgs(minutes=float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)))
