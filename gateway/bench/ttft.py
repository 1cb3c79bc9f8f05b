"""`tiergate bench ttft`: time to first token of the cheap tiers through the gateway, on the
bundled demo model, at 1 and at 16 concurrent clients.

`tiergate serve` runs in a subprocess with the repository's own ``config.yaml`` (so the tiers,
the local engine and its settings are what ``make run`` serves), only its database, journal and
feedback folder moved to a temporary directory and its relative paths made absolute. Clients
(aiohttp, in this process) stream chat completions naming a tier as the model (``none``,
``low``: the tiers the router sends easy requests to), each a short question with
``max_tokens`` 32; a client sends its next request when its stream ends (closed loop). Time to
first token: from sending the request to the first SSE chunk that carries content (the first
generated text, not the role chunk); also printed: the time to the end of the stream and the
output tokens/s per stream. The machine's other cores are shared with the clients (2 cores:
the server and the clients compete, as a single-machine deployment would).

The promise measured against: a cheap-tier request's first token in under 200 ms.
Bench-only (gateway.bench): imported lazily by the CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[2]
ADMIN_KEY = "tiergate-bench-ttft-admin"
PROMPTS = ("What is the capital of France?", "Say hello in Spanish.", "Name a primary colour.",
           "What is two plus two?", "Give me a word that rhymes with cat.", "What day comes after Monday?")
TARGET_S = 0.200


@dataclass(frozen=True)
class TtftArgs:
    tiers: tuple[str, ...] = ("none", "low")
    clients: tuple[int, ...] = (1, 16)
    requests: int = 48  # per tier and client count (after a warm-up of 4)
    max_tokens: int = 32
    config: Path = REPO / "config.yaml"


@dataclass(frozen=True)
class Sample:
    ttft_s: float
    total_s: float
    tokens: int


def _config(work: Path, source: Path) -> Path:
    """``source`` with its state moved to ``work`` and every path absolute."""
    cfg: dict[str, Any] = yaml.safe_load(source.read_text())
    base = source.resolve().parent

    def absolute(value: str) -> str:
        return value if os.path.isabs(value) else str(base / value)

    cfg["database"] = {"url_env": "TIERGATE_BENCH_TTFT_UNSET_DB_URL", "default_url": f"sqlite:///{work / 'ttft.db'}"}
    cfg["redis"] = {"url_env": "TIERGATE_BENCH_TTFT_UNSET_REDIS_URL"}
    cfg.setdefault("ledger", {})["journal_dir"] = str(work / "journal")
    classifier = cfg.setdefault("classifier", {})
    if "artifact" in classifier:
        classifier["artifact"] = absolute(classifier["artifact"])
    classifier["feedback_dir"] = str(work / "classifier")
    for model in (cfg.get("models") or {}).values():
        if model.get("provider") == "local":
            for key in ("model", "draft_model"):
                if model.get(key):
                    model[key] = absolute(model[key])
    cfg.setdefault("server", {})["log_level"] = "warning"
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def _stream(client: aiohttp.ClientSession, base: str, tier: str, prompt: str, max_tokens: int) -> Sample:
    body = {"model": tier, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": prompt}], "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.post(base + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{tier}: HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = int(chunk["usage"].get("completion_tokens") or 0)
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{tier}: the stream carried no content")
    return Sample(first - t0, end - t0, tokens)


async def _measure(base: str, key: str, tier: str, clients: int, requests: int, max_tokens: int
                   ) -> tuple[list[Sample], float]:
    """The timed samples (after a warm-up) and the seconds they took."""
    headers = {"Authorization": f"Bearer {key}"}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=clients)) as client:
        for i in range(4):  # warm-up: the engine's first steps, the connections
            await _stream(client, base, tier, PROMPTS[i % len(PROMPTS)], max_tokens)
        samples: list[Sample] = []
        todo = list(range(requests))
        t0 = time.perf_counter()

        async def worker() -> None:
            while todo:
                i = todo.pop()
                samples.append(await _stream(client, base, tier, PROMPTS[i % len(PROMPTS)], max_tokens))

        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return samples, wall


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_ttft(args: TtftArgs) -> str:
    from gateway.bench.gateway import _free_port, _process, _tiergate_key

    out: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tiergate-ttft-") as tmp:
        work = Path(tmp)
        config = _config(work, args.config)
        key = _tiergate_key(config)  # a tenant and its key in the bench's database
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        env = {**os.environ, "TIERGATE_ADMIN_KEY": ADMIN_KEY}
        cmd = [sys.executable, "-c", "from gateway.cli import main; main()", "serve", "--config", str(config),
               "--port", str(port)]
        out.append(f"tiergate bench ttft: `tiergate serve` with {args.config} (the bundled demo model's tiers), "
                   f"streamed chat requests naming a tier, max_tokens {args.max_tokens}, {args.requests} requests per "
                   f"row after 4 warm-up; {os.cpu_count()} cores shared by the server and the clients")
        out.append(f"{'tier':<8}{'clients':>8}{'TTFT p50 ms':>13}{'p90 ms':>9}{'p99 ms':>9}{'stream p50 ms':>15}"
                   f"{'tok/s/stream':>14}{'agg tok/s':>11}   < {TARGET_S * 1000:.0f} ms at p50 / p90")
        with _process(cmd, base + "/readyz", work / "serve.log", env=env, timeout_s=300):
            for tier in args.tiers:
                for clients in args.clients:
                    samples, wall = asyncio.run(_measure(base, key, tier, clients, args.requests, args.max_tokens))
                    ttft = [s.ttft_s for s in samples]
                    per_stream = [s.tokens / max(s.total_s - s.ttft_s, 1e-9) for s in samples if s.tokens > 1]
                    verdict = " / ".join("met" if _pct(ttft, q) < TARGET_S else "NOT met" for q in (0.5, 0.9))
                    out.append(f"{tier:<8}{clients:>8}{statistics.median(ttft) * 1000:>13.1f}"
                               f"{_pct(ttft, 0.9) * 1000:>9.1f}{_pct(ttft, 0.99) * 1000:>9.1f}"
                               f"{statistics.median(s.total_s for s in samples) * 1000:>15.1f}"
                               f"{statistics.median(per_stream) if per_stream else float('nan'):>14.1f}"
                               f"{sum(s.tokens for s in samples) / wall:>11.1f}   {verdict}")
    out.append("note: TTFT from sending the request to the first chunk with generated text (auth, routing, the "
               "ledger's intent, the engine's queue and prefill included); agg tok/s: output tokens of all streams over the "
               "row's wall time")
    return "\n".join(out)
