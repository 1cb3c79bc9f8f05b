"""`tiergate bench obs-paired`: what metrics and tracing cost a server, measured on two servers that
run *at the same time* on the same core.

`tiergate bench gateway` times each server alone, round after round; on a shared machine the load
of other jobs changes between two targets' turns, so its per-round RPS ratios of two identical
servers (the A/A control) span ±15-50%, more than the 5% to be shown. Here each round runs the
baseline (metrics and tracing off) and one variant side by side: both real ``tiergate serve``
processes (one worker, the journaled ledger on SQLite, the bench's mock upstream) pinned to the
same core, each driven by its own closed-loop load generator at the same concurrency, started
and stopped together. Whatever else the machine does in that window it does to both. Measured per
server over the window: requests answered and its CPU time (every thread's, from /proc; the event
loop's thread, the process's main one, also alone, so the report says which side the cost is on), so:

- **CPU per request, baseline over variant**: the share of RPS a CPU-bound server keeps with the
  variant's observability on (RPS = CPU available / CPU per request). This is the figure held to
  the target (≥ 0.95: at most 5% of RPS lost): its median over the rounds, and beside it a
  distribution-free interval of that median (the rounds' order statistics,
  gateway.bench.intervals.median_interval) saying whether the rounds settle the target (met: the
  whole interval within 5%; NOT met: all of it above; else not settled — 8 rounds give only their
  extremes, at 99% coverage);
- **RPS ratio**: the variant's requests over the baseline's in the same window. Both servers
  compete for one core under the kernel's fair scheduler, so this is roughly the same ratio, but
  it also moves with how the scheduler splits the core between the two processes' threads.

An A/A pair (the baseline against a second server configured identically) runs in every round
too: its spread is the floor under every other figure. Both pairs of a round start their servers
in the same order (alternated by round), and the server started first costs a few percent more
CPU a request (the A/A rounds alternate by ~4% on the development machine), so each variant is
also given over the A/A pair of its own round, which cancels that at the price of the control's
noise. Variants run in a rotating order within a
round. The OTLP variants export with the real OTLP/HTTP exporter to the bench's receiver
(``python -m gateway.bench.tools sink``, on the load core), so encoding and sending are in the
server's CPU: on the SDK's default schedule (a batch every 5 s, ``--export-delay-ms``), and each
window is followed by a quiet longer than that, so every span it recorded is encoded and sent
before its CPU is read. (Until 2026-12-04 the schedule was shortened to 0.75 s to keep the
windows short: ~7x as many batches as a default server sends, each ~0.6-1.2 ms of CPU whatever
its size.) Added p50 latency (the second target) is `tiergate bench gateway`'s: sequential
requests, one server at a time.

Bench-only: imported lazily by gateway.cli.bench.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.bench.gateway import (
    REQUEST,
    _cpu_s,
    _free_port,
    _pin,
    _process,
    serve_tiergate,
)
from gateway.bench.intervals import interval_verdict, median_interval

BASE = "no-metrics"
COST_TARGET = 0.05  # at most 5% of RPS (CPU per request) for a variant's observability
COST_SHOWN = f"{COST_TARGET:.0%}"
VARIANTS: dict[str, dict[str, Any]] = {
    BASE: {"metrics": {"enabled": False}},
    "no-metrics-b": {"metrics": {"enabled": False}},  # the A/A control
    "metrics": {"metrics": {"enabled": True}},  # the default
    "metrics+otlp@0.1": {"metrics": {"enabled": True}, "tracing": {"enabled": True, "exporter": "otlp",
                                                                 "endpoint": "{sink}", "sample_ratio": 0.1}},
    # what the tracing switch costs alone: every request's sampling decision and upstream traceparent,
    # nothing sampled; and sampling at 0.1 with no exporter (the spans recorded, not encoded or sent)
    "metrics+otlp@0": {"metrics": {"enabled": True}, "tracing": {"enabled": True, "exporter": "otlp",
                                                               "endpoint": "{sink}", "sample_ratio": 0.0}},
    "metrics+tracing-no-export@0": {"metrics": {"enabled": True},
                                    "tracing": {"enabled": True, "exporter": "none", "sample_ratio": 0.0}},
    "metrics+tracing-no-export@0.1": {"metrics": {"enabled": True},
                                      "tracing": {"enabled": True, "exporter": "none", "sample_ratio": 0.1}},
    "metrics+otlp@1.0": {"metrics": {"enabled": True}, "tracing": {"enabled": True, "exporter": "otlp",
                                                                 "endpoint": "{sink}", "sample_ratio": 1.0}},
}


@dataclass(frozen=True)
class PairedArgs:
    rounds: int = 8
    duration_s: float = 4.0
    concurrency: int = 16  # per server
    warmup: int = 300  # requests per server before the window, uncounted
    settle_s: float = 1.5  # the least quiet after the warm-up and after the window (see quiet_s)
    # the span processor's export schedule (OTEL_BSP_SCHEDULE_DELAY), the SDK's default: batches of
    # the size a default server sends (a shorter one sends more, smaller batches: more CPU a span)
    export_delay_ms: int = 5000
    server_core: int = 0
    load_core: int = 1
    variants: tuple[str, ...] = ("no-metrics-b", "metrics", "metrics+otlp@0.1", "metrics+otlp@1.0")
    base: str = BASE  # the variant every other one runs beside
    # PYTHONHASHSEED of every server: None, a new one each round (both servers of a round's pairs
    # share it); a number, that one throughout (see run)
    hash_seed: int | None = None

    @property
    def quiet_s(self) -> float:
        """The quiet after the warm-up and after the window: long enough for a scheduled export
        to run in it, so the window's spans are encoded and sent before its CPU is read."""
        return max(self.settle_s, self.export_delay_ms / 1000 + 0.5)


@dataclass(frozen=True)
class Pair:
    """One round's window for one variant: requests and CPU seconds of the baseline and the variant."""

    base_requests: int
    base_cpu_s: float
    requests: int
    cpu_s: float
    base_rps: float
    rps: float
    # of the CPU seconds above, the event loop's thread's (the process's main thread: uvicorn runs the
    # app there); the rest is the other threads' (the ledger's journal and database writers, the
    # metrics' folder, the span processor's exporter)
    base_loop_cpu_s: float = float("nan")
    loop_cpu_s: float = float("nan")

    @property
    def cpu_ratio(self) -> float:
        """Baseline CPU per request over the variant's (1.0: free; 0.95: 5% of RPS lost)."""
        return (self.base_cpu_s / max(self.base_requests, 1)) / max(self.cpu_s / max(self.requests, 1), 1e-12)

    @property
    def rps_ratio(self) -> float:
        return self.rps / max(self.base_rps, 1e-9)


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    key: str
    pid: int


def _load_cmd(s: Server, concurrency: int, *, duration_s: float = 0.0, requests: int = 0, core: int) -> list[str]:
    return [*_pin(core), sys.executable, "-m", "gateway.bench.tools", "load", "--url", s.url,
            "--body", orjson.dumps(REQUEST).decode(), "--key", s.key, "--concurrency", str(concurrency),
            "--duration", str(duration_s or 3600), "--requests", str(requests), "--warmup", "0"]


def _drive(servers: tuple[Server, Server], args: PairedArgs, order: tuple[int, int], **load: Any) -> list[Any]:
    started = {i: subprocess.Popen(_load_cmd(servers[i], args.concurrency, core=args.load_core, **load),
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for i in order}
    outs = [started[i].communicate(timeout=900)[0] for i in (0, 1)]
    got = [orjson.loads(o.strip().splitlines()[-1]) for o in outs]
    for s, r, i in zip(servers, got, (0, 1), strict=True):
        if started[i].returncode != 0 or r["errors"]:
            raise RuntimeError(f"load on {s.name} failed: rc {started[i].returncode}, {r['errors']} errors")
    return got


def _pair(base: Server, variant: Server, args: PairedArgs, swap: bool = False) -> Pair:
    """Drive both servers at once: first ``args.warmup`` requests each, uncounted (a fresh server's
    first requests import and build what later ones reuse); then ``args.duration_s`` seconds,
    followed by ``args.quiet_s`` of quiet so the span processors' scheduled exports of the spans
    the window recorded run inside it (``OTEL_BSP_SCHEDULE_DELAY``: the quiet outlasts it). CPU is
    read before and after the window (the servers' every thread, /proc), requests counted by the
    load generators. ``swap``: the variant's generator starts first (alternated by round)."""
    servers, order = (base, variant), ((1, 0) if swap else (0, 1))
    _drive(servers, args, order, requests=args.warmup)
    time.sleep(args.quiet_s)  # the warm-up's spans exported before the window
    cpu0 = [_cpu_s(base.pid), _cpu_s(variant.pid), _cpu_s(base.pid, base.pid), _cpu_s(variant.pid, variant.pid)]
    got = _drive(servers, args, order, duration_s=args.duration_s)
    time.sleep(args.quiet_s)
    cpu1 = [_cpu_s(base.pid), _cpu_s(variant.pid), _cpu_s(base.pid, base.pid), _cpu_s(variant.pid, variant.pid)]
    return Pair(int(got[0]["requests"]), cpu1[0] - cpu0[0], int(got[1]["requests"]), cpu1[1] - cpu0[1],
                float(got[0]["rps"]), float(got[1]["rps"]), cpu1[2] - cpu0[2], cpu1[3] - cpu0[3])


def _start(stack: ExitStack, work: Path, name: str, upstream: str, sink: str, args: PairedArgs,
           env: dict[str, str]) -> Server:
    """A fresh ``tiergate serve`` for variant ``name`` over its own new database and journal."""
    home = Path(tempfile.mkdtemp(prefix=name.replace("@", "-").replace("+", "-") + "-", dir=work))
    observability = orjson.loads(orjson.dumps(VARIANTS[name]).replace(b"{sink}", sink.encode()))
    s = serve_tiergate(stack, home, upstream, args.server_core, env, home / "server.log", observability=observability)
    return Server(name, s.url, s.key, s.pid)


def run(args: PairedArgs) -> list[str]:
    unknown = {*args.variants, args.base} - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    work = Path(tempfile.mkdtemp(prefix="tiergate-obs-paired-"))
    # String hashing (dict layouts) is the same for every server of a round, so the servers of its pairs
    # differ only in their config; by default a new seed each round: a fixed one makes one layout's luck
    # (where each configuration's dicts and objects fall in memory and in the caches) part of every
    # round, the same for a variant each time, and so a bias no number of rounds averages out
    seeds = random.Random()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "TIERGATE_BENCH_DATABASE_URL": "",
           "PYTHONHASHSEED": str(args.hash_seed if args.hash_seed is not None else 0),
           # the span processor's export schedule, set (whatever this environment says): the SDK's
           # default unless asked otherwise; every pair's quiet after its window outlasts it
           "OTEL_BSP_SCHEDULE_DELAY": str(args.export_delay_ms)}
    pairs: dict[str, list[Pair]] = {v: [] for v in args.variants}
    try:
        with ExitStack() as stack:
            mock_port, sink_port = _free_port(), _free_port()
            upstream, sink = f"http://127.0.0.1:{mock_port}/v1", f"http://127.0.0.1:{sink_port}"
            stack.enter_context(_process([*_pin(args.load_core), sys.executable, "-m", "gateway.bench.tools", "mock",
                                          "--port", str(mock_port)], f"{upstream}/models", work / "mock.log", env))
            stack.enter_context(_process([*_pin(args.load_core), sys.executable, "-m", "gateway.bench.tools", "sink",
                                          "--port", str(sink_port)], f"{sink}/stats", work / "sink.log", env))
            for round_no in range(args.rounds):
                if args.hash_seed is None:
                    env["PYTHONHASHSEED"] = str(seeds.randrange(1, 2**32))
                k = round_no % len(args.variants)
                for name in args.variants[k:] + args.variants[:k]:  # a rotating order
                    sys.stderr.write(f"  round {round_no + 1}/{args.rounds}: {args.base} + {name} ...\n")
                    # a fresh pair each time: no server carries a bigger database or a longer history
                    # than its partner, and an instance's own luck (memory layout) is not in every round
                    swap = round_no % 2 == 1  # which server starts first, and whose load starts first
                    with ExitStack() as servers:
                        if swap:
                            variant = _start(servers, work, name, upstream, sink, args, env)
                            base = _start(servers, work, args.base, upstream, sink, args, env)
                        else:
                            base = _start(servers, work, args.base, upstream, sink, args, env)
                            variant = _start(servers, work, name, upstream, sink, args, env)
                        pairs[name].append(_pair(base, variant, args, swap=swap))
            exported = httpx.get(f"{sink}/stats", timeout=10).json()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(pairs, args, exported)


def _against_control(ps: list[Pair], control: list[float]) -> str:
    """The variant's CPU ratio over the A/A pair's of the same round. Both pairs of a round start
    their servers in the same order (alternated by round), and which server starts first moves
    the ratio by a few percent (the A/A pair's own rounds show it); dividing by the control's
    ratio cancels that, at the price of the control's noise."""
    costs = [1 - p.cpu_ratio / c for p, c in zip(ps, control, strict=True)]
    return f"costs {statistics.median(costs) * 100:+.1f}% of RPS (median; {_cost_interval(costs, 'interval')})"


def _cost_interval(costs: list[float], label: str) -> str:
    """``costs``' median interval (the rounds' order statistics) and whether it settles the target."""
    low, high, coverage = median_interval(costs)
    return (f"{coverage:.0%} {label} {low * 100:+.1f}%..{high * 100:+.1f}%: "
            f"{interval_verdict(low, high, coverage, COST_TARGET, shown=COST_SHOWN)})")


def _threads(pairs: dict[str, list[Pair]]) -> list[str]:
    """Where each variant's CPU per request goes: the event loop's thread and the others, baseline ->
    variant (medians of the rounds, and the median of the rounds' differences), when the rounds measured
    them."""
    lines = []
    for name, ps in pairs.items():
        ps = [p for p in ps if not (math.isnan(p.loop_cpu_s) or math.isnan(p.base_loop_cpu_s))]
        if not ps:
            continue
        loop = [(p.base_loop_cpu_s / max(p.base_requests, 1) * 1e6, p.loop_cpu_s / max(p.requests, 1) * 1e6) for p in ps]
        rest = [((p.base_cpu_s - p.base_loop_cpu_s) / max(p.base_requests, 1) * 1e6,
                 (p.cpu_s - p.loop_cpu_s) / max(p.requests, 1) * 1e6) for p in ps]
        lines.append(f"{name}: us/req, baseline -> variant (medians; in parentheses the median of the rounds' "
                     f"differences): event-loop thread "
                     f"{statistics.median(b for b, _ in loop):.1f} -> {statistics.median(v for _, v in loop):.1f} "
                     f"({statistics.median(v - b for b, v in loop):+.1f}), other threads "
                     f"{statistics.median(b for b, _ in rest):.1f} -> {statistics.median(v for _, v in rest):.1f} "
                     f"({statistics.median(v - b for b, v in rest):+.1f})")
    return [*lines, ""] if lines else []


def _spread(values: list[float]) -> str:
    return f"[{min(values):.3f}..{max(values):.3f}]"


def report(pairs: dict[str, list[Pair]], args: PairedArgs, exported: dict[str, Any] | None = None) -> list[str]:
    what = "metrics and tracing off" if args.base == BASE else "as configured in VARIANTS"
    lines = [f"tiergate bench obs-paired: each variant's server beside the baseline ({args.base}: {what}), both on core {args.server_core} at the same time, {args.concurrency} connections each for "
             f"{args.duration_s:g} s, {args.rounds} rounds (load generators, mock upstream and OTLP receiver on "
             f"core {args.load_core}; spans exported every {args.export_delay_ms} ms; PYTHONHASHSEED "
             f"{'a new one each round' if args.hash_seed is None else args.hash_seed})", "",
             f"{'variant':<20}{'CPU us/req':>12}{'base us/req':>13}{'CPU ratio':>11}   {'per round':<16}"
             f"{'RPS ratio':>10}   per round"]
    control: list[float] = []
    for name, ps in pairs.items():
        if not ps:
            continue
        cpu = [p.cpu_ratio for p in ps]
        rps = [p.rps_ratio for p in ps]
        if name == "no-metrics-b" and args.base == BASE:
            control = cpu
        us = statistics.median(p.cpu_s / max(p.requests, 1) * 1e6 for p in ps)
        base_us = statistics.median(p.base_cpu_s / max(p.base_requests, 1) * 1e6 for p in ps)
        lines.append(f"{name:<20}{us:>12.1f}{base_us:>13.1f}{statistics.median(cpu):>11.3f}   {_spread(cpu):<16}"
                     f"{statistics.median(rps):>10.3f}   {_spread(rps)}")
    lines.append("")
    for name, ps in pairs.items():
        if ps:
            lines.append(f"{name}: CPU ratio by round (rounds 2, 4, ...: the variant's server started first) "
                         + " ".join(f"{p.cpu_ratio:.3f}" for p in ps))
    lines.append("")
    lines += _threads(pairs)
    lines.append("CPU ratio: the baseline's CPU per request over the variant's, median of the rounds (the RPS share "
                 "a CPU-bound server keeps; target >= 0.95). RPS ratio: requests answered, variant over baseline, "
                 "in the same window.")
    if control:
        lines.append(f"noise floor (A/A: two identical servers): CPU ratio median {statistics.median(control):.3f}, "
                     f"rounds {_spread(control)}")
    for name, ps in pairs.items():
        if name == "no-metrics-b" or not ps:
            continue
        med = statistics.median(p.cpu_ratio for p in ps)
        verdict = "met" if med >= 0.95 else "NOT met"
        lines.append(f"{name}: costs {(1 - med) * 100:+.1f}% of RPS (CPU per request) -> RPS target (<= 5%) {verdict} "
                     f"(median; {_cost_interval([1 - p.cpu_ratio for p in ps], 'interval of it')})")
        if len(control) == len(ps):
            lines.append(f"  {name} over the A/A pair of its own round: {_against_control(ps, control)}")
    if exported:
        lines.append(f"OTLP receiver: {exported['requests']} export requests, {exported['spans']} spans, "
                     f"{exported['bytes'] / 1e6:.1f} MB")
    return lines
