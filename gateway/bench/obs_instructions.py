"""`tiergate bench obs-instructions`: what metrics and tracing cost a server, in CPU instructions per
request counted by valgrind's callgrind — a count, not a time, so it does not swing with what else
the machine runs (the timed figures of `tiergate bench gateway` on a shared 2-core machine swing by
±10-50% per round, more than the 5% to be shown).

Each variant is a real ``tiergate serve`` (one worker, the journaled ledger on SQLite, the bench's
mock upstream) started under ``valgrind --tool=callgrind --instr-atstart=no``: startup and a warm-up
of ``warmup`` requests run uncounted, then counting is switched on (``callgrind_control -i on``) for
``requests`` requests at ``concurrency`` concurrent connections, switched off and dumped; the
dump's total (every thread's instructions) over the requests is the figure. Every variant runs
``runs`` times, interleaved, so the spread of one variant's runs (the ledger's batching and the
event loop's iterations depend on timing) shows what a difference must exceed to mean anything.

What it leaves out: the OTLP exporter's batches. Under valgrind a server is ~50x slower, so the
span processor's 5 s schedule would export a batch every few dozen requests instead of every few
thousand; the exporter runs with ``exporter: none`` here and its cost per span is measured on its
own (`tiergate bench gateway`'s in-process report: the encoding CPU per span).

Bench-only: imported lazily by gateway.cli.bench. Needs valgrind (Debian's package).
"""

from __future__ import annotations

import os
import re
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

import orjson

from gateway.bench.gateway import REQUEST, _free_port, _process, _tiergate_config, _tiergate_key

VARIANTS: dict[str, dict[str, Any]] = {
    "off": {"metrics": {"enabled": False}},
    "metrics": {"metrics": {"enabled": True}},  # the default
    "metrics+tracing@0": {"metrics": {"enabled": True},
                          "tracing": {"enabled": True, "exporter": "none", "sample_ratio": 0.0}},
    "metrics+tracing@0.1": {"metrics": {"enabled": True},
                            "tracing": {"enabled": True, "exporter": "none", "sample_ratio": 0.1}},
    "metrics+tracing@1.0": {"metrics": {"enabled": True},
                            "tracing": {"enabled": True, "exporter": "none", "sample_ratio": 1.0}},
}
_TOTALS = re.compile(rb"^(?:totals|summary):\s*(\d+)", re.MULTILINE)


def dump_total(path: Path) -> int:
    """The instruction total of a callgrind dump (its ``totals:`` line; ``summary:`` in older ones)."""
    values = [int(v) for v in _TOTALS.findall(path.read_bytes())]
    if not values:
        raise RuntimeError(f"no totals in {path}")
    return max(values)


@dataclass(frozen=True)
class Run:
    variant: str
    instructions: int
    requests: int

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests


def _load(url: str, key: str, concurrency: int, n: int) -> None:
    cmd = [sys.executable, "-m", "gateway.bench.tools", "load", "--url", url, "--body", orjson.dumps(REQUEST).decode(),
           "--key", key, "--concurrency", str(concurrency), "--requests", str(n), "--warmup", "0",
           "--duration", "3600"]
    out = orjson.loads(subprocess.run(cmd, check=True, capture_output=True).stdout)
    if out["requests"] != n or out["errors"]:
        raise RuntimeError(f"load: {out}")


def _one(work: Path, name: str, observability: dict[str, Any], upstream: str, args: InstructionArgs,
         env: dict[str, str], round_no: int) -> Run:
    home = work / f"{name.replace('@', '-').replace('+', '-')}-{round_no}"
    home.mkdir()
    config = _tiergate_config(home, upstream, observability=observability)
    key, port = _tiergate_key(config), _free_port()
    out = home / "callgrind.out"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", sys.executable, "-c",
           "from gateway.cli import main; main()", "serve", "--config", str(config), "--port", str(port)]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    with _process(cmd, f"http://127.0.0.1:{port}/readyz", home / "server.log", env, timeout_s=900) as pid:
        _load(url, key, args.concurrency, args.warmup)
        subprocess.run(["callgrind_control", "-i", "on", str(pid)], check=True, capture_output=True)
        _load(url, key, args.concurrency, args.requests)
        subprocess.run(["callgrind_control", "-i", "off", str(pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
        deadline = time.monotonic() + 60
        while not (dumps := sorted(home.glob("callgrind.out.*"))) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not dumps:
            raise RuntimeError(f"{name}: no callgrind dump in {home}")
        time.sleep(1)  # the dump is written once the server's next instruction block runs
    return Run(name, dump_total(dumps[0]), args.requests)


@dataclass(frozen=True)
class InstructionArgs:
    requests: int = 300
    warmup: int = 100
    concurrency: int = 32
    runs: int = 2
    variants: tuple[str, ...] = tuple(VARIANTS)


def run(args: InstructionArgs) -> list[str]:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        return ["valgrind not installed (Debian: apt-get install valgrind): nothing measured"]
    work = Path(tempfile.mkdtemp(prefix="tiergate-bench-instr-"))
    mock_port = _free_port()
    upstream = f"http://127.0.0.1:{mock_port}/v1"
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "TIERGATE_BENCH_DATABASE_URL": "",
           "PYTHONHASHSEED": "0"}
    runs: list[Run] = []
    try:
        with ExitStack() as stack:
            stack.enter_context(_process([sys.executable, "-m", "gateway.bench.tools", "mock", "--port", str(mock_port)],
                                         f"{upstream}/models", work / "mock.log", env))
            for round_no in range(args.runs):
                order = list(args.variants) if round_no % 2 == 0 else list(args.variants)[::-1]
                for name in order:
                    sys.stderr.write(f"  counting {name} (run {round_no + 1}/{args.runs}) ...\n")
                    runs.append(_one(work, name, VARIANTS[name], upstream, args, env, round_no))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(runs, args)


def report(runs: list[Run], args: InstructionArgs) -> list[str]:
    by: dict[str, list[float]] = {}
    for r in runs:
        by.setdefault(r.variant, []).append(r.per_request)
    base = statistics.median(by["off"]) if "off" in by else None
    lines = [f"tiergate bench obs-instructions: CPU instructions per request (callgrind, every thread of the server), "
             f"{args.requests} requests at concurrency {args.concurrency} after {args.warmup} uncounted, "
             f"{args.runs} interleaved runs per variant",
             f"{'variant':<22}{'instr/req (median)':>20}{'runs':>34}{'vs off':>10}{'run spread':>12}"]
    for name, values in by.items():
        med = statistics.median(values)
        spread = (max(values) - min(values)) / med * 100
        vs = f"{(med / base - 1) * 100:+.1f}%" if base else "-"
        lines.append(f"{name:<22}{med:>20,.0f}{', '.join(f'{v:,.0f}' for v in values):>34}{vs:>10}{spread:>11.1f}%")
    if base:
        off_spread = by["off"]
        lines.append(f"a difference smaller than the runs' own spread (off: "
                     f"{(max(off_spread) - min(off_spread)) / base * 100:.1f}%) is not a difference; the target "
                     f"(<= 5% RPS) as instructions: a variant's median at most 5% above off's")
        for name, values in by.items():
            if name != "off":
                share = statistics.median(values) / base - 1
                lines.append(f"  {name}: {share * 100:+.1f}% -> {'met' if share <= 0.05 else 'NOT met'}")
    lines.append("not counted: the OTLP exporter's batches (see the module's doc; their encoding per span is in "
                 "`tiergate bench gateway`'s in-process report)")
    return lines
