"""`tiergate bench gateway`: gateway overhead against a mock upstream, measured in one run.

Starts the mock OpenAI upstream (``gateway.bench.tools mock``), then measures with the same load
generator (``gateway.bench.tools load``): direct-to-mock; through tiergate (``tiergate serve``: auth and
the journaled ledger on, SQLite, one uvicorn worker; ``ledger.durability`` process — the default —
plus fsync and none variants); and through the LiteLLM proxy from
``.venv-litellm-proxy`` (``make bench-venv``; one worker, same upstream; skipped with a note if
absent), plus a bare FastAPI + aiohttp pass-through as the floor. All servers run at once and
are measured interleaved, round by round (median of 3), so load changes on a shared machine
hit every target alike. Servers under test are pinned to one core with taskset, the load
generator and the mock to another (when the machine has two). Prints RPS at fixed
concurrency, added p50/p99 latency at concurrency 1 versus direct, and the ratios.

Bench-only: imported lazily by gateway.cli.bench.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

REQUEST = {"model": "low", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16}
LITELLM_MODEL = "bench-model"
LITELLM_MASTER_KEY = "sk-litellm-bench-master"


@dataclass(frozen=True)
class Phase:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int = 0  # answered (warm-up included)
    cpu_us: float = float("nan")  # the server process's CPU time (all its threads) per request answered


WARMUP = 50  # sequential requests before each measured phase


def _cpu_s(pid: int | None, thread: int | None = None) -> float:
    """CPU time (user + system) the process has used so far, all its threads, or only ``thread``'s
    (a thread id; the process's own id: its main thread); nan if unknown."""
    if pid is None:
        return float("nan")
    try:
        stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(core: int | None) -> list[str]:
    if core is None or core < 0 or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", str(core)]


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited early:\n{log.read_text(errors='replace')[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s}s:\n{log.read_text(errors='replace')[-2000:]}")


@contextmanager
def _process(cmd: list[str], ready_url: str, log: Path, env: dict[str, str] | None = None,
             timeout_s: float = 120) -> Iterator[int]:
    """Start ``cmd``, wait until ``ready_url`` answers; yields its pid (taskset execs the command)."""
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env or dict(os.environ),
                            start_new_session=True)
    try:
        _wait_http(ready_url, proc, timeout_s, log)
        yield proc.pid
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def _load(url: str, body: dict[str, Any], key: str, concurrency: int, core: int | None, *,
          duration_s: float = 0.0, requests: int = 0) -> Phase:
    cmd = [*_pin(core), sys.executable, "-m", "gateway.bench.tools", "load", "--url", url,
           "--body", orjson.dumps(body).decode(), "--key", key, "--concurrency", str(concurrency),
           "--duration", str(duration_s or 3600), "--requests", str(requests), "--warmup", str(WARMUP)]
    out = subprocess.run(cmd, capture_output=True, check=True, timeout=900).stdout
    r = orjson.loads(out.strip().splitlines()[-1])
    nan = float("nan")  # no successful request: shown as nan, with the error count
    return Phase(r["rps"], r["p50_ms"] if r["p50_ms"] is not None else nan,
                 r["p99_ms"] if r["p99_ms"] is not None else nan, r["errors"], WARMUP + r["requests"] + r["errors"])


def _measure(name: str, url: str, body: dict[str, Any], key: str, args: BenchArgs,
             pid: int | None = None) -> tuple[Phase, Phase]:
    """Latency at concurrency 1, then RPS at ``args.concurrency``; with the server's ``pid``, the
    throughput phase carries the server's CPU time per request over both phases."""
    sys.stderr.write(f"  measuring {name} ...\n")
    cpu0 = _cpu_s(pid)
    latency = _load(url, body, key, 1, args.load_core, requests=args.latency_requests)
    throughput = _load(url, body, key, args.concurrency, args.load_core, duration_s=args.duration_s)
    served = latency.requests + throughput.requests
    cpu_us = (_cpu_s(pid) - cpu0) / max(served, 1) * 1e6
    return latency, dataclasses.replace(throughput, cpu_us=cpu_us)


@dataclass(frozen=True)
class BenchArgs:
    concurrency: int = 32
    duration_s: float = 5.0
    latency_requests: int = 500
    server_core: int | None = 0
    load_core: int | None = 1
    litellm_venv: Path = Path(".venv-litellm-proxy")
    nowait_variant: bool = True
    rounds: int = 3
    observability_variants: bool = True
    only_observability: bool = False  # direct + the tiergate observability variants only
    cost_requests: int = 100  # in-process CPU cost: requests per variant and round (0: skip)
    cost_rounds: int = 30  # many short interleaved rounds: each pair of variants measured close in time


# The default tiergate target runs the default observability: Prometheus metrics on, tracing off.
# "{sink}": the bench's OTLP receiver (gateway.bench.tools sink), filled in when the servers start.
OBSERVABILITY: dict[str, dict[str, Any]] = {
    "tiergate-no-metrics": {"metrics": {"enabled": False}},
    # the A/A control: a second server configured as tiergate-no-metrics, measured as a variant is (the
    # spread two identical servers show here is the noise floor of every ratio below)
    "tiergate-no-metrics-b": {"metrics": {"enabled": False}},
    # tracing as an operator runs it: metrics on, the default ratio, the real OTLP/HTTP exporter (batched,
    # protobuf) sending to a local receiver: the spans' encoding and sending are in the server's CPU too
    "tiergate-otlp@0.1": {"metrics": {"enabled": True}, "tracing": {"enabled": True, "exporter": "otlp",
                                                                  "endpoint": "{sink}", "sample_ratio": 0.1}},
    "tiergate-otlp": {"metrics": {"enabled": True}, "tracing": {"enabled": True, "exporter": "otlp",
                                                              "endpoint": "{sink}", "sample_ratio": 1.0}},
}


def _tiergate_config(work: Path, upstream: str, durability: str = "process",
                     observability: dict[str, Any] | None = None) -> Path:
    model = {"provider": "openai", "model": "mock", "api_base": upstream, "context_window": 8192,
             "price": {"input": 0.5, "output": 1.5}}
    cfg = {"server": {"log_level": "warning"},
           "database": {"url_env": "TIERGATE_BENCH_DATABASE_URL", "default_url": "sqlite:///tiergate-bench.db"},
           "ledger": {"journal_dir": "journal", "durability": durability},
           "models": {"mock": model},
           "tiers": {t: {"model": "mock"} for t in ("none", "minimal", "low", "medium", "high", "xhigh")}}
    if observability is not None:
        cfg["observability"] = observability
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _tiergate_key(config: Path) -> str:
    from gateway.auth import generate_key, hash_key
    from gateway.db import migrate
    from gateway.db.queries import add_api_key, create_tenant
    from gateway.db.session import database_url, make_engine, make_session_factory
    from gateway.settings import load_settings

    url = database_url(load_settings(config))
    migrate.upgrade(url.render_as_string(hide_password=False))
    engine = make_engine(url)
    raw = generate_key()
    with make_session_factory(engine)() as s, s.begin():
        tenant = create_tenant(s, "bench")
        add_api_key(s, tenant.id, raw, hash_key(raw))
    engine.dispose()
    return raw


def _ledger_rows(config: Path) -> int:
    import sqlalchemy as sa

    from gateway.db.models import LedgerEntryRow
    from gateway.db.session import database_url, make_engine

    engine = make_engine(database_url(_settings(config)))
    with engine.connect() as conn:
        n = conn.execute(sa.select(sa.func.count()).select_from(LedgerEntryRow)).scalar_one()
    engine.dispose()
    return int(n)


def _settings(config: Path) -> Any:
    from gateway.settings import load_settings

    return load_settings(config)


def _litellm_config(work: Path, upstream: str) -> Path:
    cfg = {"model_list": [{"model_name": LITELLM_MODEL, "litellm_params": {
               "model": f"openai/{LITELLM_MODEL}", "api_base": upstream, "api_key": "sk-mock"}}],
           "general_settings": {"master_key": LITELLM_MASTER_KEY},
           "litellm_settings": {"telemetry": False, "drop_params": True}}
    path = work / "litellm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    body: dict[str, Any]
    key: str
    pid: int | None = None  # the server's process (its CPU time per request); None: not measured


def _median_phase(phases: list[Phase]) -> Phase:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    return Phase(med([p.rps for p in phases]), med([p.p50_ms for p in phases]), med([p.p99_ms for p in phases]),
                 sum(p.errors for p in phases), sum(p.requests for p in phases), med([p.cpu_us for p in phases]))


@dataclass(frozen=True)
class Served:
    """A `tiergate serve` started for a bench: its chat URL, its tenant's key, its pid, its config."""

    url: str
    key: str
    pid: int
    config: Path


def serve_tiergate(stack: ExitStack, home: Path, upstream: str, core: int | None, env: dict[str, str], log: Path,
                   **config: Any) -> Served:
    """`tiergate serve` (pinned to ``core``) over a new database and journal in ``home``, with a
    tenant and key, ready when this returns; stopped when ``stack`` closes. ``config``: what
    ``_tiergate_config`` takes (``durability``, ``observability``)."""
    path = _tiergate_config(home, upstream, **config)
    key, port = _tiergate_key(path), _free_port()
    cmd = [*_pin(core), sys.executable, "-c", "from gateway.cli import main; main()",
           "serve", "--config", str(path), "--port", str(port)]
    pid = stack.enter_context(_process(cmd, f"http://127.0.0.1:{port}/readyz", log, env))
    return Served(f"http://127.0.0.1:{port}/v1/chat/completions", key, pid, path)


def _tiergate_target(stack: ExitStack, work: Path, name: str, upstream: str, durability: str, args: BenchArgs,
                     env: dict[str, str], observability: dict[str, Any] | None = None) -> tuple[Target, Path]:
    home = work / name
    home.mkdir()
    s = serve_tiergate(stack, home, upstream, args.server_core, env, work / f"{name}.log", durability=durability,
                       observability=observability)
    return Target(name, s.url, REQUEST, s.key, s.pid), s.config


def run_gateway_bench(args: BenchArgs) -> str:
    """Start every server, then measure them interleaved (round by round, median per target),
    so load changes on a shared machine hit all targets alike."""
    cores = os.cpu_count() or 1
    if cores < 2:
        args = dataclasses.replace(args, server_core=None, load_core=None)
    work = Path(tempfile.mkdtemp(prefix="tiergate-bench-"))
    mock_port = _free_port()
    upstream = f"http://127.0.0.1:{mock_port}/v1"
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "TIERGATE_BENCH_DATABASE_URL": ""}
    notes: list[str] = []
    targets = [Target("direct", f"{upstream}/chat/completions", REQUEST, "none")]
    with ExitStack() as stack:
        mock_cmd = [*_pin(args.load_core), sys.executable, "-m", "gateway.bench.tools", "mock",
                    "--port", str(mock_port)]
        stack.enter_context(_process(mock_cmd, f"http://127.0.0.1:{mock_port}/v1/models", work / "mock.log", env))
        if args.only_observability:
            args = dataclasses.replace(args, nowait_variant=False, observability_variants=True)
        bare_port = _free_port()
        bare_cmd = [*_pin(args.server_core), sys.executable, "-m", "gateway.bench.tools", "bare",
                    "--port", str(bare_port), "--upstream", upstream]
        if not args.only_observability:
            bare_pid = stack.enter_context(_process(bare_cmd, f"http://127.0.0.1:{bare_port}/healthz",
                                                    work / "bare.log", env))
            targets.append(Target("bare-fastapi", f"http://127.0.0.1:{bare_port}/v1/chat/completions", REQUEST,
                                  "none", bare_pid))
            notes.append("bare-fastapi: FastAPI + aiohttp pass-through with no auth, validation or ledger "
                         "(the floor for a Python gateway on this machine)")
        target, config = _tiergate_target(stack, work, "tiergate", upstream, "process", args, env)
        targets.append(target)
        if args.nowait_variant:
            targets.append(_tiergate_target(stack, work, "tiergate-fsync", upstream, "fsync", args, env)[0])
            targets.append(_tiergate_target(stack, work, "tiergate-nowait", upstream, "none", args, env)[0])
            notes.append("tiergate: ledger.durability=process, the default (responses wait until their ledger "
                         "rows are written to the journal: kill -9 safe; fdatasync follows in the background); "
                         "tiergate-fsync: durability=fsync (responses wait for the fdatasync); tiergate-nowait: "
                         "durability=none (rows journaled within ms but not awaited)")
        if args.observability_variants:
            sink_port = _free_port()
            sink = f"http://127.0.0.1:{sink_port}"
            sink_cmd = [*_pin(args.load_core), sys.executable, "-m", "gateway.bench.tools", "sink",
                        "--port", str(sink_port)]
            stack.enter_context(_process(sink_cmd, f"{sink}/stats", work / "sink.log", env))
            for name, observability in OBSERVABILITY.items():
                observability = orjson.loads(orjson.dumps(observability).replace(b"{sink}", sink.encode()))
                targets.append(_tiergate_target(stack, work, name, upstream, "process", args, env, observability)[0])
            notes.append("tiergate: Prometheus metrics on (the default), tracing off; tiergate-no-metrics: metrics "
                         "off; tiergate-no-metrics-b: the same again (the A/A control: two identical servers); "
                         "tiergate-otlp@0.1: metrics and OpenTelemetry tracing on with the OTLP/HTTP exporter "
                         "sending to a local receiver, sample_ratio 0.1 (the default ratio); tiergate-otlp: the same "
                         "at 1.0 (every request's spans)")
        litellm_bin = args.litellm_venv / "bin" / "litellm"
        if args.only_observability:
            pass
        elif litellm_bin.exists():
            ll_port = _free_port()
            ll_cmd = [*_pin(args.server_core), str(litellm_bin), "--config", str(_litellm_config(work, upstream)),
                      "--host", "127.0.0.1", "--port", str(ll_port), "--num_workers", "1"]
            ll_env = {**env, "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False", "DISABLE_SCHEMA_UPDATE": "True"}
            try:
                ll_pid = stack.enter_context(_process(ll_cmd, f"http://127.0.0.1:{ll_port}/health/liveliness",
                                                      work / "litellm.log", ll_env, timeout_s=240))
                targets.append(Target("litellm", f"http://127.0.0.1:{ll_port}/v1/chat/completions",
                                      {**REQUEST, "model": LITELLM_MODEL}, LITELLM_MASTER_KEY, ll_pid))
                notes.append("LiteLLM proxy ran with master-key auth and no database (its spend logs need "
                             "PostgreSQL), i.e. with less work per request than tiergate")
            except RuntimeError as err:
                notes.append(f"LiteLLM proxy failed to start: {str(err)[:300]}")
        else:
            notes.append(f"LiteLLM proxy not installed ({litellm_bin} missing; run `make bench-venv`): "
                         "measured the others only")
        measured: dict[str, list[tuple[Phase, Phase]]] = {t.name: [] for t in targets}
        for round_no in range(args.rounds):
            # A B C, then C B A: a drift in the machine's load within a round hits every target alike
            for t in targets if round_no % 2 == 0 else targets[::-1]:
                measured[t.name].append(_measure(f"{t.name} (round {round_no + 1}/{args.rounds})", t.url, t.body,
                                                 t.key, args, t.pid))
        if args.observability_variants:
            got = httpx.get(f"{sink}/stats", timeout=10).json()
            notes.append(f"OTLP receiver: {got['requests']} export requests, {got['spans']} spans, "
                         f"{got['bytes'] / 1e6:.1f} MB from the tiergate-otlp targets")
        cost_lines: list[str] = []
        if args.observability_variants and args.cost_requests > 0:
            from gateway.bench import obs_cost

            sys.stderr.write("  measuring the in-process CPU cost per request ...\n")
            cost_lines = obs_cost.report(obs_cost.measure(upstream, args.cost_requests, args.cost_rounds),
                                         args.cost_requests, args.cost_rounds, obs_cost.sdk_floor(),
                                         obs_cost.encoding_cost())
    rows = _ledger_rows(config)
    notes.append(f"ledger rows written by the durable tiergate run: {rows} (auth + journaled ledger on, SQLite)")
    shutil.rmtree(work, ignore_errors=True)
    results = {name: (_median_phase([m[0] for m in ms]), _median_phase([m[1] for m in ms]))
               for name, ms in measured.items()}
    return _report(results, notes, args, cores, measured, cost_lines)


def _spread(values: list[float]) -> str:
    return f"[{min(values):.3g}..{max(values):.3g}]"


def _paired(measured: dict[str, list[tuple[Phase, Phase]]], variant: str, base: str
            ) -> tuple[list[float], list[float], list[float]]:
    """Per round: the variant's RPS over the base's, its p50 minus the base's (ms), and the
    base's server CPU per request over the variant's (the RPS ratio a CPU-bound server would see)."""
    pairs = list(zip(measured[variant], measured[base], strict=True))
    return ([v[1].rps / max(b[1].rps, 1e-9) for v, b in pairs], [v[0].p50_ms - b[0].p50_ms for v, b in pairs],
            [b[1].cpu_us / v[1].cpu_us for v, b in pairs if v[1].cpu_us > 0])


def _report(results: dict[str, tuple[Phase, Phase]], notes: list[str], args: BenchArgs, cores: int,
            measured: dict[str, list[tuple[Phase, Phase]]] | None = None, cost_lines: list[str] | None = None) -> str:
    measured = measured or {}
    direct_lat = results["direct"][0]
    lines = [f"tiergate bench gateway: concurrency {args.concurrency} for {args.duration_s:.0f}s (RPS); "
             f"{args.latency_requests} sequential requests (latency); median of {args.rounds} interleaved "
             f"rounds; {cores} cores, server core "
             f"{args.server_core}, load+mock core {args.load_core}",
             "", f"{'target':<20}{'RPS@c':>10}{'p50 ms':>10}{'p99 ms':>10}{'+p50 ms':>10}{'+p99 ms':>10}"
                 f"{'errors':>8}{'CPU us/req':>12}   RPS spread [min..max]"]
    for name, (lat, thr) in results.items():
        added50, added99 = lat.p50_ms - direct_lat.p50_ms, lat.p99_ms - direct_lat.p99_ms
        spread = _spread([m[1].rps for m in measured[name]]) if measured.get(name) else ""
        lines.append(f"{name:<20}{thr.rps:>10.1f}{lat.p50_ms:>10.3f}{lat.p99_ms:>10.3f}"
                     f"{added50 if name != 'direct' else 0:>10.3f}{added99 if name != 'direct' else 0:>10.3f}"
                     f"{lat.errors + thr.errors:>8}{thr.cpu_us:>12.0f}   {spread}")
    lines.append("")
    tg = results["tiergate"]
    lines.append(f"tiergate / direct RPS: {tg[1].rps / results['direct'][1].rps:.3f}")
    if "bare-fastapi" in results:
        bare = results["bare-fastapi"]
        lines.append(f"tiergate / bare pass-through RPS: {tg[1].rps / max(bare[1].rps, 1e-9):.3f}; added p50 "
                     f"{tg[0].p50_ms - direct_lat.p50_ms:.3f} ms vs {bare[0].p50_ms - direct_lat.p50_ms:.3f} ms")
    if "litellm" in results:
        ll = results["litellm"]
        tg_add = max(tg[0].p50_ms - direct_lat.p50_ms, 1e-3)
        ll_add = ll[0].p50_ms - direct_lat.p50_ms
        lines.append(f"tiergate / LiteLLM RPS: {tg[1].rps / max(ll[1].rps, 1e-9):.2f}x  (target >= 10x)")
        lines.append(f"tiergate added p50 / LiteLLM added p50: {tg_add / max(ll_add, 1e-9):.3f}  (target <= 0.10)")
        for variant in ("tiergate-fsync", "tiergate-nowait"):
            if variant in results:
                nw = results[variant]
                nw_add = max(nw[0].p50_ms - direct_lat.p50_ms, 1e-3)
                lines.append(f"{variant} / LiteLLM RPS: {nw[1].rps / max(ll[1].rps, 1e-9):.2f}x; added p50 "
                             f"ratio {nw_add / max(ll_add, 1e-9):.3f}")
    base = results.get("tiergate-no-metrics")
    if base is not None:
        for variant in [n for n in results if n in ("tiergate", "tiergate-no-metrics-b")
                        or n.startswith(("tiergate-traced", "tiergate-otlp"))]:
            v = results[variant]
            what = "A/A control (noise floor)" if variant == "tiergate-no-metrics-b" else "observability cost"
            line = (f"{what}, {variant} vs tiergate-no-metrics: RPS ratio "
                    f"{v[1].rps / max(base[1].rps, 1e-9):.3f} (target >= 0.95), added p50 "
                    f"{v[0].p50_ms - base[0].p50_ms:+.3f} ms (target <= 0.1)")
            if measured.get(variant) and measured.get("tiergate-no-metrics"):
                ratios, added, cpu = _paired(measured, variant, "tiergate-no-metrics")
                line += (f"; per round: RPS ratio median {statistics.median(ratios):.3f} {_spread(ratios)}, "
                         f"added p50 median {statistics.median(added):+.3f} ms {_spread(added)}")
                cpu = [c for c in cpu if c == c]  # nan: CPU time not readable
                if cpu:
                    line += (f"; server CPU per request ratio (off / on) median {statistics.median(cpu):.3f} "
                             f"{_spread(cpu)}")
            lines.append(line)
    if cost_lines:
        lines += ["", *cost_lines]
    lines += ["", *("note: " + n for n in notes)]
    return "\n".join(lines)
