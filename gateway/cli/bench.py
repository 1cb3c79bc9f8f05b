"""`tiergate bench`: benchmarks that print ratios against a baseline run in the same process.

Thin typer dispatch: each command parses its options and calls its benchmark in gateway.bench.
`tiergate bench routing` is classifier_cmd.bench_routing (registered in gateway.cli).
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Benchmarks that print ratios against a baseline run in the same process.", no_args_is_help=True)


@app.command("pipeline")
def pipeline_bench(
    n: int = typer.Option(1000, help="requests to replay"),
    mix: str = typer.Option("0.7,0.2,0.1", help="easy,medium,hard shares of the workload (source difficulty)"),
    data_dir: str = typer.Option("../shared/data", help="the shared data folder prompts are drawn from"),
    seed: int = typer.Option(0),
    config: str = typer.Option("config.yaml", help="config whose classifier settings decide effort"),
    classifier: bool = typer.Option(True, help="let the gateway's classifier decide (when its artifact exists)"),
    outcomes: str | None = typer.Option(None, "--outcomes", help="an outcomes file (JSONL with per-arm outcomes): "
                                        "print expected quality beside cost for its prompts"),
) -> None:
    """Routed cost of a mixed workload vs answering everything on the high tier (and on the low);
    with --outcomes, the routed cost and expected quality of that file's prompts."""
    from pathlib import Path

    from gateway.bench.pipeline import run_bench
    from gateway.settings import load_settings

    if outcomes is not None:
        from gateway.bench.quality import run_quality

        typer.echo(run_quality(Path(outcomes), n, seed, load_settings(config) if classifier else None))
        return

    shares = tuple(float(x) for x in mix.split(","))
    if len(shares) != 3:
        raise typer.BadParameter("mix needs three shares: easy,medium,hard")
    settings = load_settings(config) if classifier else None
    try:
        typer.echo(run_bench(Path(data_dir), n, (shares[0], shares[1], shares[2]), seed, settings))
    except FileNotFoundError as err:
        raise typer.BadParameter(f"{err} (point --data-dir at the shared data folder)") from None


@app.command("gateway")
def gateway_bench(
    concurrency: int = typer.Option(32, help="connections for the RPS phase"),
    duration: float = typer.Option(5.0, help="seconds of the RPS phase per target"),
    latency_requests: int = typer.Option(500, help="sequential requests for the latency phase"),
    server_core: int = typer.Option(0, help="core the server under test is pinned to (taskset; -1: no pinning)"),
    load_core: int = typer.Option(1, help="core for the load generator and the mock upstream (-1: no pinning)"),
    litellm_venv: str = typer.Option(".venv-litellm-proxy", help="venv with litellm[proxy] (make bench-venv)"),
    rounds: int = typer.Option(3, min=1, help="interleaved rounds (median of them)"),
    observability: bool = typer.Option(True, help="also measure metrics off and metrics + tracing on"),
    only_observability: bool = typer.Option(False, "--only-observability",
                                            help="measure direct and the tiergate observability variants only"),
    cost_requests: int = typer.Option(100, help="in-process CPU cost: requests per variant and round (0: skip)"),
    cost_rounds: int = typer.Option(30, min=1, help="in-process CPU cost: interleaved rounds"),
) -> None:
    """Gateway overhead: direct-to-mock vs tiergate (auth + ledger on) vs the LiteLLM proxy."""
    from pathlib import Path

    from gateway.bench.gateway import BenchArgs, run_gateway_bench

    typer.echo(run_gateway_bench(BenchArgs(concurrency, duration, latency_requests, server_core, load_core,
                                           Path(litellm_venv), rounds=rounds, observability_variants=observability,
                                           only_observability=only_observability, cost_requests=cost_requests,
                                           cost_rounds=cost_rounds)))


@app.command("engine")
def engine_bench(
    quick: bool = typer.Option(False, "--quick", help="a ~15M-parameter model instead of ~200M (smoke run)"),
    threads: int | None = typer.Option(None, "--threads", help="torch threads for engine and HF (default: all)"),
    decode_tokens: int | None = typer.Option(None, "--decode-tokens", help="tokens generated per measurement"),
    repeats: int = typer.Option(3, "--repeats", help="best of this many runs per figure"),
    demo: str = typer.Option("engine/models/demo-moe", "--demo", help="demo model for part (d)"),
    data_dir: str = typer.Option("../shared/data", "--data-dir", help="held-out text for part (d)"),
    ppl_windows: int = typer.Option(8, "--ppl-windows", help="held-out windows for the perplexity in (d)"),
    skip_random: bool = typer.Option(False, "--skip-random", help="run the demo-model parts only"),
    draft: str = typer.Option("engine/models/demo-draft", "--draft", help="draft model for part (f)"),
    only: str = typer.Option("a,b,c,d,e,f,g", "--only",
                             help="comma-separated parts: a-d (first round), e quantized weights, f speculative, "
                                  "g prefix cache"),
    config: str | None = typer.Option(None, "--config", help="config.yaml whose prices (g) uses"),
    quantization: bool = typer.Option(True, "--quantization/--no-quantization",
                                      help="part (e): q8_0 / q4_0 decode and prefill vs the engine's bf16"),
    prefill_tokens: int = typer.Option(256, "--prefill-tokens", help="prompt length of the prefill rows in (e)"),
    llama_cpp: bool = typer.Option(True, "--llama-cpp/--no-llama-cpp",
                                   help="part (e): the engine vs llama.cpp on the same GGUF files (`make "
                                        "bench-llama-cpp` builds llama.cpp; skipped with a note without it)"),
    llama_cpp_threads: str = typer.Option("1,2", "--llama-cpp-threads", help="comma-separated thread counts"),
    llama_cpp_rounds: int = typer.Option(5, "--llama-cpp-rounds", min=1, help="interleaved rounds (medians)"),
    llama_cpp_models: str = typer.Option("random,demo", "--llama-cpp-models",
                                         help="comma-separated: random (the bench MoE), demo"),
) -> None:
    """Engine speed vs HF transformers, memory-bandwidth use, batching scale-up, k=1 vs trained k,
    quantized weights (e), speculative decoding (f), prefix-cache time to first token and its ledger cost (g)."""
    from pathlib import Path

    from gateway.bench.engine import run

    parts = {p.strip() for p in only.split(",") if p.strip()}
    try:
        cpp_threads = [int(t) for t in llama_cpp_threads.split(",") if t.strip()]
    except ValueError:
        raise typer.BadParameter(f"not a list of thread counts: {llama_cpp_threads}",
                                 param_hint="--llama-cpp-threads") from None
    try:
        run(quick=quick, threads=threads, decode_tokens=decode_tokens, repeats=repeats, demo=Path(demo),
            data_dir=Path(data_dir), ppl_windows=ppl_windows, skip_random=skip_random, echo=typer.echo,
            draft=Path(draft), only=parts, config=Path(config) if config else None,
            quantization=quantization, prefill_tokens=prefill_tokens, llama_cpp=llama_cpp,
            llama_cpp_threads=cpp_threads, llama_cpp_rounds=llama_cpp_rounds,
            llama_cpp_models={m.strip() for m in llama_cpp_models.split(",") if m.strip()})
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--only / --llama-cpp-models") from None


@app.command("ledger")
def ledger_pg_bench(
    postgres_url: str = typer.Option("postgresql+psycopg://postgres@127.0.0.1:5432/test", envvar="TIERGATE_BENCH_POSTGRES_URL",
                                     help="A PostgreSQL database to connect to; a temporary database is created beside it and dropped."),
    requests: int = typer.Option(24000, help="chat requests per kind of phase (ledger off, on), split over the rounds"),
    rounds: int = typer.Option(12, help="ABBA rounds of one ledger-off and one ledger-on phase (each round's p99 "
                                        "ratio swings ±30% on a shared 2-core machine: 4 rounds give a noisy median)"),
    concurrency: int = typer.Option(32),
    upstream_ms: float = typer.Option(20.0, help="simulated upstream latency per call"),
    extra_rows_per_s: float = typer.Option(2500.0, help="extra ledger rows/s recorded while serving"),
    seed_rows: int = typer.Option(1_000_000, help="ledger rows seeded before timing the spend summary"),
    open_fractions: str = typer.Option("0.3,0.6", "--open-fractions",
                                       help="open-loop offered loads, as shares of the ledger-off open-loop capacity "
                                       "(measured first: the highest Poisson rate it keeps up with), comma-separated (one set of rounds each; 0 or empty: closed loop only)"),
) -> None:
    """Ledger rows/s into PostgreSQL while serving (p99 vs ledger off, closed and open loop) and spend-summary latency."""
    from gateway.bench.ledger_pg import run

    fractions = tuple(float(x) for x in open_fractions.split(",") if x.strip())
    if any(not 0 <= f <= 1 for f in fractions):
        raise typer.BadParameter("each share must be within [0, 1]", param_hint="--open-fractions")
    for line in run(postgres_url, requests, concurrency, upstream_ms, extra_rows_per_s, seed_rows, rounds,
                    fractions):
        typer.echo(line)


@app.command("journal-writes")
def journal_writes_bench(
    directory: str | None = typer.Option(None, help="where to write (default: the temp dir; use the journal's disk)"),
    rounds: int = typer.Option(4), seconds: float = typer.Option(2.0, help="per variant and round"),
) -> None:
    """Ledger journal write(2) latency beside a syncing thread: appending vs a preallocated segment."""
    from gateway.bench.journal_writes import run

    for line in run(directory, rounds, seconds):
        typer.echo(line)


@app.command("obs-instructions")
def obs_instructions_bench(
    requests: int = typer.Option(300, help="counted requests per run"),
    warmup: int = typer.Option(100, help="uncounted requests first"),
    concurrency: int = typer.Option(32), runs: int = typer.Option(2, help="interleaved runs per variant"),
    variants: str = typer.Option(",".join(["off", "metrics", "metrics+tracing@0", "metrics+tracing@0.1",
                                           "metrics+tracing@1.0"]), help="comma-separated"),
) -> None:
    """Metrics and tracing cost per request in CPU instructions (valgrind callgrind): a count, steady on a busy machine."""
    from gateway.bench.obs_instructions import InstructionArgs, run

    for line in run(InstructionArgs(requests, warmup, concurrency, runs, tuple(v for v in variants.split(",") if v))):
        typer.echo(line)


@app.command("obs-paired")
def obs_paired_bench(
    rounds: int = typer.Option(8, min=1, help="rounds (every variant once per round, beside the baseline)"),
    duration: float = typer.Option(4.0, help="seconds of load per pair"),
    concurrency: int = typer.Option(16, help="connections per server"),
    variants: str = typer.Option("no-metrics-b,metrics,metrics+otlp@0.1,metrics+otlp@1.0", help="comma-separated"),
    base: str = typer.Option("no-metrics", help="the variant every other one runs beside"),
    export_delay_ms: int = typer.Option(5000, min=100, help="the span processor's export schedule "
                                        "(OTEL_BSP_SCHEDULE_DELAY; 5000: the SDK's default)"),
    hash_seed: int = typer.Option(-1, min=-1, help="every server's PYTHONHASHSEED (-1: a new one each round)"),
) -> None:
    """Metrics and tracing cost per request, each variant's server run beside the baseline at the same time on one core."""
    from gateway.bench.obs_paired import PairedArgs, run

    args = PairedArgs(rounds, duration, concurrency, variants=tuple(v for v in variants.split(",") if v), base=base,
                      export_delay_ms=export_delay_ms, hash_seed=None if hash_seed < 0 else hash_seed)
    for line in run(args):
        typer.echo(line)


@app.command("ledger-sqlite")
def ledger_sqlite_bench(n: int = typer.Option(3000, help="Entries per variant."),
                        concurrency: int = typer.Option(64, help="Concurrent writers.")) -> None:
    """Ledger rows/s: naive per-call transaction vs record_durable vs record (SQLite, temp dir)."""
    from gateway.bench.ledger_sqlite import run

    for line in run(n, concurrency):
        typer.echo(line)


@app.command("batches")
def batches_bench(
    lines: int = typer.Option(48, help="lines in the batch"),
    delay_ms: float = typer.Option(500.0, help="the mock upstream's fixed latency per call"),
    workers: int = typer.Option(2, min=2, help="workers of the second run (the first has one)"),
    concurrency: int = typer.Option(2, min=1, help="jobs.concurrency: lines in flight per worker"),
    chunk_lines: int = typer.Option(4, min=1, help="jobs.chunk_lines: lines per Celery task"),
    broker_url: str = typer.Option("amqp://guest:guest@127.0.0.1:5672//", envvar="TIERGATE_BROKER_URL",
                                   help="the Celery broker (a private queue is used)"),
    database_url: str | None = typer.Option(None, help="a database URL (default: a temporary SQLite file)"),
) -> None:
    """One batch on 1 Celery worker vs on N workers, against an upstream with a fixed latency."""
    from gateway.bench.batches import BatchBenchArgs, run_batches_bench

    typer.echo(run_batches_bench(BatchBenchArgs(lines, delay_ms, workers, concurrency, chunk_lines, broker_url,
                                                database_url)))


@app.command("dashboard")
def dashboard_bench(
    postgres_url: str = typer.Option("postgresql+psycopg://postgres@127.0.0.1:5432/test", envvar="TIERGATE_BENCH_POSTGRES_URL",
                                     help="A PostgreSQL database to connect to; a temporary database is created beside it and dropped."),
    tenants: int = typer.Option(1000, help="tenants seeded (3 keys each, a budget on every tenth)"),
    rows: int = typer.Option(1_000_000, help="requests seeded (each with one ledger row) over 90 days"),
    repeats: int = typer.Option(50, help="timed requests per page"),
    keep_database: bool = typer.Option(False, help="leave the seeded database (its URL is printed) for EXPLAIN or profiling"),
) -> None:
    """Every admin console page at scale: p50/p99 server time, and the ratio to a page with no database."""
    from gateway.bench.dashboard import run

    for line in run(postgres_url, tenants, rows, repeats, keep=keep_database):
        typer.echo(line)


@app.command("soak")
def soak_bench(
    minutes: float = typer.Option(20.0, help="length of the soak"),
    sample_s: float = typer.Option(30.0, help="seconds between samples"),
    load: float = typer.Option(0.7, help="share of the measured max RPS to run at"),
    upstream_ms: float = typer.Option(20.0, help="mock upstream latency per call"),
) -> None:
    """Mixed traffic for N minutes: RSS, fds, /healthz p99, ledger lag over time, then the invariant."""
    from gateway.bench.soak import SoakArgs, run_soak

    typer.echo(run_soak(SoakArgs(minutes=minutes, sample_s=sample_s, load=load, upstream_ms=upstream_ms)))


@app.command("disconnect")
def disconnect_bench(
    streams: int = typer.Option(200, min=1, help="concurrent streaming clients of the measured phase"),
    baseline_streams: int = typer.Option(10, min=1, help="concurrent streaming clients of the baseline phase"),
    seconds: float = typer.Option(15.0, help="length of each phase"),
    chunk_ms: float = typer.Option(50.0, help="the mock upstream's interval between chunks, per stream"),
    rounds: int = typer.Option(2, min=1, help="interleaved rounds of the many-streams phase on each server"),
) -> None:
    """Client disconnect to upstream stopped: p50/p99 latency with few and with many concurrent streams,
    and the cut calls' billing (cancelled, the tokens delivered)."""
    from gateway.bench.disconnect import DisconnectArgs, run_disconnect_bench

    typer.echo(run_disconnect_bench(DisconnectArgs(streams, baseline_streams, seconds, chunk_ms, rounds)))


@app.command("ttft")
def ttft_bench(
    requests: int = typer.Option(48, help="timed streams per tier and client count"),
    max_tokens: int = typer.Option(32),
    config: Path = typer.Option(Path("config.yaml"), help="the config whose tiers are served (its state is moved to a temp dir)"),
) -> None:
    """Time to first token of the none/low tiers through `tiergate serve` on the bundled model, 1 and 16 clients."""
    from gateway.bench.ttft import TtftArgs, run_ttft

    typer.echo(run_ttft(TtftArgs(requests=requests, max_tokens=max_tokens, config=config.resolve())))
