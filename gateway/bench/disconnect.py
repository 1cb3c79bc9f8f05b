"""`tiergate bench disconnect`: how soon a streaming client that goes away stops the upstream call,
with a few concurrent streams (the baseline) and with many, against `tiergate serve`.

Three processes: a streaming mock upstream (``python -m gateway.bench.disconnect mock``: a bare
asyncio HTTP/1.1 server sending one SSE chunk every ``--chunk-ms`` per stream, and writing, for
every stream, the moment its connection from the gateway was lost and how many chunks it had
sent), `tiergate serve` (SQLite, the journaled ledger, one worker), and the clients in this
process (uvloop, raw sockets). Each client keeps one stream open at a time: it reads the
stream for a random 0.5-2.5 s, then aborts its connection (the moment is noted) and opens the
next. The latency of one disconnect is the time from the client's abort to the upstream seeing
the gateway drop that call (both clocks are the machine's CLOCK_MONOTONIC). The many-streams
phase runs in interleaved rounds against two servers of the same app: `tiergate serve` (whose
protocol reports a lost connection to the stream at once, gateway.web.hangup) and the same
uvicorn settings with uvicorn's stock httptools protocol (the disconnect seen through
``receive()``, as before). Printed per phase:
p50 / p99 / max of that latency, the streams the upstream never saw stopped, and from the
ledger: the cut calls billed ``cancelled`` and their billed output tokens against the chunks
the upstream sent before the drop (billing stops at what was delivered). Then the ratios: many
streams vs the baseline, and the hook vs the stock protocol. Numbers taken on a shared, busy machine are noisy.

Bench-only: imported lazily by gateway.cli.bench; the mock runs as this module's ``main``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

MODEL = "mock"


@dataclass(frozen=True)
class DisconnectArgs:
    streams: int = 200
    baseline_streams: int = 10
    seconds: float = 15.0
    chunk_ms: float = 50.0
    rounds: int = 2
    seed: int = 11


@dataclass
class Phase:
    label: str  # unique per phase: the streams' tags start with it
    streams: int
    cuts: dict[str, float] = field(default_factory=dict)  # tag -> monotonic time of the client's abort
    request_ids: dict[str, str] = field(default_factory=dict)  # tag -> x-request-id
    received: dict[str, int] = field(default_factory=dict)  # tag -> SSE events the client read
    errors: int = 0


# -- the mock upstream (its own process) --------------------------------------------------------
class _Stream(asyncio.Protocol):
    def __init__(self, interval_s: float, max_chunks: int, log: Any) -> None:
        self.interval_s, self.max_chunks, self.log = interval_s, max_chunks, log
        self.buf, self.tag, self.sent, self.done = b"", "", 0, False
        self.timer: asyncio.TimerHandle | None = None
        self.transport: Any = None  # uvloop's TCPTransport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.tag:
            return
        self.buf += data
        head, sep, body = self.buf.partition(b"\r\n\r\n")
        if not sep:
            return
        m = re.search(rb"content-length:\s*(\d+)", head, re.I)
        if m is None or len(body) < int(m.group(1)):
            return
        req = orjson.loads(body[:int(m.group(1))])
        self.tag = str(req["messages"][-1]["content"])
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                             b"connection: close\r\n\r\n")
        self._tick()

    def _write(self, payload: bytes) -> None:
        assert self.transport is not None
        self.transport.write(b"%x\r\n%s\r\n" % (len(payload), payload))

    def _tick(self) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return
        if self.sent >= self.max_chunks:
            self.done = True
            self._write(b"data: [DONE]\n\n")
            self.transport.write(b"0\r\n\r\n")
            self.transport.close()
            return
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                 "choices": [{"index": 0, "delta": {"content": "w "}, "finish_reason": None}]}
        self._write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        self.sent += 1
        self.timer = asyncio.get_running_loop().call_later(self.interval_s, self._tick)

    def connection_lost(self, exc: Exception | None) -> None:
        now = time.monotonic()
        if self.timer is not None:
            self.timer.cancel()
        if self.tag:
            self.log.write(f"{self.tag} {now:.6f} {self.sent} {int(self.done)}\n")
            self.log.flush()


def run_mock(port: int, chunk_ms: float, events: Path, max_chunks: int) -> None:
    import uvloop

    async def serve() -> None:
        with events.open("a") as log:
            server = await asyncio.get_running_loop().create_server(
                lambda: _Stream(chunk_ms / 1000, max_chunks, log), "127.0.0.1", port, backlog=1024)
            async with server:
                await server.serve_forever()

    uvloop.run(serve())


# -- the clients (this process) -------------------------------------------------------------------
async def _client(port: int, key: str, phase: Phase, stop_at: float, rng: random.Random, ident: int) -> None:
    n = 0
    while time.monotonic() < stop_at:
        n += 1
        tag = f"{phase.label}-c{ident}-{n}"
        body = orjson.dumps({"model": MODEL, "stream": True, "max_tokens": 4000,
                             "messages": [{"role": "user", "content": tag}]})
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                   b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
                   + b"\r\n\r\n" + body)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            phase.errors += 1
            await asyncio.sleep(0.2)
            continue
        if not head.startswith(b"HTTP/1.1 200"):
            phase.errors += 1
            writer.close()
            await asyncio.sleep(0.2)
            continue
        m = re.search(rb"x-request-id:\s*(\S+)", head, re.I)
        events = 0
        cut_at = time.monotonic() + rng.uniform(0.5, 2.5)
        while (left := cut_at - time.monotonic()) > 0:
            try:
                data = await asyncio.wait_for(reader.read(65536), left)
            except TimeoutError:
                break
            if not data:
                break
            events += data.count(b"data: ")
        phase.cuts[tag] = time.monotonic()
        writer.transport.abort()  # the client goes away mid-stream
        phase.received[tag] = events
        if m is not None:
            phase.request_ids[tag] = m.group(1).decode()


async def _phase(label: str, port: int, key: str, streams: int, seconds: float, seed: int) -> Phase:
    phase = Phase(label, streams)
    stop_at = time.monotonic() + seconds
    rng = random.Random(seed)
    clients = [_client(port, key, phase, stop_at, random.Random(rng.random()), i) for i in range(streams)]

    async def staggered(i: int, c: Any) -> None:
        await asyncio.sleep(i * 0.5 / streams)  # open the streams over half a second
        await c

    await asyncio.gather(*(staggered(i, c) for i, c in enumerate(clients)))
    return phase


# -- the report -------------------------------------------------------------------------------------
def _read_events(path: Path) -> dict[str, tuple[float, int, bool]]:
    out = {}
    for line in path.read_text().splitlines():
        tag, t, sent, done = line.split()
        out[tag] = (float(t), int(sent), done == "1")
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _ledger_rows(config: Path, request_ids: list[str]) -> dict[str, tuple[str, int]]:
    import sqlalchemy as sa

    from gateway.db.models import LedgerEntryRow
    from gateway.db.session import database_url, make_engine
    from gateway.settings import load_settings

    engine = make_engine(database_url(load_settings(config)))
    out: dict[str, tuple[str, int]] = {}
    with engine.connect() as conn:
        for i in range(0, len(request_ids), 500):
            q = sa.select(LedgerEntryRow.request_id, LedgerEntryRow.status, LedgerEntryRow.completion_tokens).where(
                LedgerEntryRow.request_id.in_(request_ids[i:i + 500]))
            for rid, status, tokens in conn.execute(q):
                out[rid] = (status, int(tokens))
    engine.dispose()
    return out


def _report(name: str, phases: list[Phase], events: dict[str, tuple[float, int, bool]],
            ledger: dict[str, tuple[str, int]]) -> tuple[str, float, float]:
    cuts = {t: c for p in phases for t, c in p.cuts.items()}
    request_ids = {t: r for p in phases for t, r in p.request_ids.items()}
    lat = [(events[t][0] - c) * 1000 for t, c in cuts.items() if t in events and not events[t][2]]
    never = sum(1 for t in cuts if t not in events)
    finished = sum(1 for t in cuts if t in events and events[t][2])
    rows = [(ledger.get(rid), events.get(tag)) for tag, rid in request_ids.items()]
    cancelled = [(r, e) for r, e in rows if r is not None and r[0] == "cancelled" and e is not None]
    excess = [r[1] - e[1] for r, e in cancelled]
    p50, p99 = statistics.median(lat) if lat else float("nan"), _pct(lat, 0.99)
    line = (f"  {name}: {len(cuts)} disconnects, upstream stopped after p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
            f"max {max(lat, default=float('nan')):.1f} ms; {never} never stopped, {finished} ran to their end, "
            f"{sum(p.errors for p in phases)} failed to open\n"
            f"      ledger: {len(cancelled)}/{len(request_ids)} cut calls billed 'cancelled'; billed output tokens "
            f"minus chunks the upstream sent before the drop: "
            f"{f'min {min(excess)}, max {max(excess)}' if excess else 'n/a'}")
    return line, p50, p99


def _config(work: Path, upstream: str) -> Path:
    model = {"provider": "openai", "model": MODEL, "api_base": upstream, "context_window": 65536,
             "max_retries": 0, "timeout_s": 120, "price": {"input": 0.5, "output": 1.5}}
    cfg = {"server": {"log_level": "warning"},
           "database": {"url_env": "TIERGATE_BENCH_DISCONNECT_DATABASE_URL",
                        "default_url": "sqlite:///tiergate-disconnect.db"},
           "ledger": {"journal_dir": "journal"},
           "models": {MODEL: model},
           "tiers": {t: {"model": MODEL, "max_output_tokens": 8192}
                     for t in ("none", "minimal", "low", "medium", "high", "xhigh")}}
    work.mkdir(parents=True, exist_ok=True)
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextlib.contextmanager
def _mock_process(cmd: list[str], port: int, log: Path) -> Iterator[None]:
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the mock upstream did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)


# The same app and uvicorn settings as `tiergate serve`, with uvicorn's stock httptools protocol: a
# lost connection reaches the response only through receive() (what tiergate served before).
_STOCK = ("import os; from gateway.settings import load_settings; from gateway.web.serving import run, uvicorn_config; "
          "run(uvicorn_config(load_settings(os.environ['TIERGATE_CONFIG']), app='gateway.cli.serve:app_from_env', "
          "host='127.0.0.1', port={port}, http='httptools'))")


@dataclass
class _Server:
    name: str
    config: Path
    key: str
    port: int
    cmd: list[str]
    phases: list[Phase] = field(default_factory=list)


def _server(work: Path, name: str, upstream: str, stock: bool) -> _Server:
    from gateway.bench.gateway import _free_port
    from gateway.bench.soak import _tenant

    config = _config(work / name, upstream)
    _tenant_id, key = _tenant(config)
    port = _free_port()
    cmd = ([sys.executable, "-c", _STOCK.format(port=port)] if stock else
           [sys.executable, "-c", "from gateway.cli import main; main()", "serve", "--config", str(config),
            "--port", str(port)])
    return _Server(name, config, key, port, cmd)


def run_disconnect_bench(args: DisconnectArgs) -> str:
    import uvloop

    from gateway.bench.gateway import _free_port, _process
    from gateway.bench.soak import ADMIN_KEY

    with tempfile.TemporaryDirectory(prefix="tiergate-disconnect-") as tmp:
        work = Path(tmp)
        mock_port = _free_port()
        events = work / "upstream-events.txt"
        max_chunks = int(60_000 / args.chunk_ms)  # a minute of chunks: no stream ends on its own
        upstream = f"http://127.0.0.1:{mock_port}/v1"
        hook, stock = _server(work, "hook", upstream, False), _server(work, "stock", upstream, True)
        mock = [sys.executable, "-m", "gateway.bench.disconnect", "mock", "--port", str(mock_port),
                "--chunk-ms", str(args.chunk_ms), "--events", str(events), "--max-chunks", str(max_chunks)]
        out = [f"tiergate bench disconnect: streams cut by their clients after 0.5-2.5 s, one chunk every "
               f"{args.chunk_ms:g} ms per stream, {args.seconds:g} s per phase, {args.rounds} interleaved rounds "
               "(a shared, busy machine: noisy)"]
        baseline: list[Phase] = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(_mock_process(mock, mock_port, work / "mock.log"))
            for srv in (hook, stock):
                env = {**os.environ, "TIERGATE_ADMIN_KEY": ADMIN_KEY, "TIERGATE_CONFIG": str(srv.config)}
                stack.enter_context(_process(srv.cmd, f"http://127.0.0.1:{srv.port}/readyz",
                                             work / f"{srv.name}.log", env=env))
            baseline.append(uvloop.run(_phase("base", hook.port, hook.key, args.baseline_streams, args.seconds,
                                              args.seed)))
            for r in range(args.rounds):
                for srv in ((hook, stock) if r % 2 == 0 else (stock, hook)):
                    srv.phases.append(uvloop.run(_phase(f"{srv.name}{r}", srv.port, srv.key, args.streams,
                                                        args.seconds, args.seed + r)))
            time.sleep(3.0)  # the last drops reach the upstream; the ledgers drain
            ledger: dict[str, tuple[str, int]] = {}
            for srv, phases in ((hook, [*baseline, *hook.phases]), (stock, stock.phases)):
                rids = [rid for p in phases for rid in p.request_ids.values()]
                for _ in range(50):
                    rows = _ledger_rows(srv.config, rids)
                    if len(rows) >= len(rids):
                        break
                    time.sleep(0.2)
                ledger.update(rows)
        upstream_events = _read_events(events)
        b_line, b50, b99 = _report(f"{args.baseline_streams:4d} streams, tiergate serve          ", baseline,
                                   upstream_events, ledger)
        h_line, h50, h99 = _report(f"{args.streams:4d} streams, tiergate serve          ", hook.phases,
                                   upstream_events, ledger)
        s_line, s50, s99 = _report(f"{args.streams:4d} streams, stock httptools protocol", stock.phases,
                                   upstream_events, ledger)
        out += [b_line, h_line, s_line,
                f"  {args.streams} vs {args.baseline_streams} streams (tiergate serve): p50 x{h50 / b50:.2f}, "
                f"p99 x{h99 / b99:.2f}; hang-up hook vs receive() at {args.streams} streams: "
                f"p50 x{h50 / s50:.2f}, p99 x{h99 / s99:.2f}"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gateway.bench.disconnect")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mock")
    m.add_argument("--port", type=int, required=True)
    m.add_argument("--chunk-ms", type=float, default=50.0)
    m.add_argument("--events", type=Path, required=True)
    m.add_argument("--max-chunks", type=int, default=1200)
    a = p.parse_args(argv)
    run_mock(a.port, a.chunk_ms, a.events, a.max_chunks)


if __name__ == "__main__":  # pragma: no cover
    main()


