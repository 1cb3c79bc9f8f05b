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

from gateway.bench.gateway import BenchArgs, Phase, _median_phase, _report
from gateway.bench.tools import run_load
from tests.gateway.scripted_upstream import UPSTREAM_KEY_ENV, ScriptedUpstream


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tool(kind: str, port: int, ready_path: str) -> tuple[subprocess.Popen[bytes], httpx.Response]:
    """``python -m gateway.bench.tools <kind>`` on ``port``, and its first answer on ``ready_path``."""
    proc = subprocess.Popen([sys.executable, "-m", "gateway.bench.tools", kind, "--port", str(port)],
                            cwd=Path(__file__).resolve().parents[3])
    deadline = time.monotonic() + 30
    while True:
        try:
            return proc, httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=1)
        except httpx.HTTPError:
            if time.monotonic() >= deadline or proc.poll() is not None:
                proc.terminate()
                raise
            time.sleep(0.1)


@pytest.mark.integration
@pytest.mark.process
async def test_mock_and_load_generator() -> None:
    port = _port()
    mock, _ = _tool("mock", port, "/v1/models")
    try:
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


@pytest.mark.integration
@pytest.mark.process
def test_otlp_sink_counts_what_the_real_exporter_sends() -> None:
    """The bench's OTLP receiver takes the SDK's OTLP/HTTP exporter's batches as a collector does
    and counts their spans (so a traced target's export is real work, and checked to arrive)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    port = _port()
    sink, first = _tool("sink", port, "/stats")
    try:
        assert first.json()["spans"] == 0
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces")))
        for i in range(3):
            provider.get_tracer("t").start_span(f"s{i}", attributes={"i": i}).end()
        provider.shutdown()
        stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5).json()
        assert stats["requests"] == 3 and stats["spans"] == 3 and stats["bytes"] > 0
    finally:
        sink.terminate()
        sink.wait(10)


def test_report_prints_ratios() -> None:
    results = {"direct": (Phase(1000, 1.0, 2.0, 0), Phase(1000, 1.0, 2.0, 0)),
               "tiergate": (Phase(500, 2.0, 4.0, 0), Phase(400, 2.0, 4.0, 0)),
               "litellm": (Phase(50, 11.0, 20.0, 0), Phase(20, 11.0, 20.0, 0))}
    out = _report(results, ["a note"], BenchArgs(), 2)
    assert "tiergate / LiteLLM RPS: 20.00x" in out
    assert "tiergate added p50 / LiteLLM added p50: 0.100" in out
    assert "note: a note" in out


def test_report_pairs_the_observability_variants_round_by_round() -> None:
    def rounds(rps: list[float], p50: list[float]) -> list[tuple[Phase, Phase]]:
        return [(Phase(0, p, p, 0), Phase(r, p, p, 0)) for r, p in zip(rps, p50, strict=True)]

    measured = {"direct": rounds([1000, 1000, 1000], [1.0, 1.0, 1.0]),
                "tiergate": rounds([450, 300, 600], [2.0, 2.5, 2.0]),
                "tiergate-no-metrics": rounds([500, 330, 610], [1.9, 2.4, 2.0]),
                "tiergate-traced": rounds([400, 270, 480], [2.2, 2.7, 2.3]),
                "tiergate-no-metrics-b": rounds([495, 335, 600], [1.9, 2.4, 2.0])}
    results = {name: (_median_phase([m[0] for m in ms]), _median_phase([m[1] for m in ms]))
               for name, ms in measured.items()}
    out = _report(results, [], BenchArgs(), 2, measured, ["in-process line"])
    # the ratio of the medians (450 / 500), then the median of the per-round ratios (0.9, 0.909, 0.984)
    assert "tiergate vs tiergate-no-metrics: RPS ratio 0.900" in out
    assert "per round: RPS ratio median 0.909 [0.9..0.984]" in out
    assert "tiergate-traced vs tiergate-no-metrics: RPS ratio 0.800" in out
    assert "RPS ratio median 0.800 [0.787..0.818]" in out and "added p50 median +0.300 ms" in out
    assert "[300..600]" in out and "in-process line" in out
    assert "A/A control (noise floor), tiergate-no-metrics-b vs tiergate-no-metrics: RPS ratio 0.990" in out


@pytest.mark.slow
def test_in_process_cost_counts_each_variants_spans(upstream: ScriptedUpstream) -> None:
    from gateway.bench import obs_cost
    from gateway.telemetry import metrics, tracing

    vs = [obs_cost.Variant("off", False, None), obs_cost.Variant("traced", True, 1.0),
          obs_cost.Variant("traced@0", True, 0.0)]
    results = obs_cost.measure(upstream.base_url, requests=3, rounds=2, vs=vs, model="up-a", api_key_env=UPSTREAM_KEY_ENV)
    by = {r.variant: r for r in results}
    # a direct request: its server span and one client span; 3 warm-up + 2 x 3 measured + 3 counted requests
    assert (by["off"].spans, by["traced"].spans, by["traced@0"].spans) == (0, 24, 0)
    assert by["traced"].calls_per_request > by["off"].calls_per_request > 0  # spans are calls too
    assert by["traced"].spans_per_request == 2 and by["traced"].attributes_per_request > 2
    assert by["traced@0"].attributes == by["off"].attributes == 0
    assert all(r.us_per_request > 0 for r in results) and by["off"].added_us == 0
    assert not tracing.enabled() and metrics.enabled()  # the process's switches as they were
    lines = obs_cost.report(results, 3, 2)
    assert lines[2].startswith("off") and "traced@0" in lines[4]


def test_cost_report_gives_a_verdict_per_variant_and_the_sdk_floor() -> None:
    from gateway.bench.obs_cost import CostResult, Floor, report

    def result(name: str, us: float, added: float, spans: int = 0, attributes: int = 0) -> CostResult:
        return CostResult(name, us, (us - 10, us + 10), added, (added - 5, added + 5), spans, attributes, 100,
                          2000 + added * 2)

    results = [result("off", 1000, 0), result("metrics", 1030, 30), result("traced", 1150, 150, 200, 2600),
               result("traced@0.1", 1040, 40, 20, 260)]
    lines = report(results, 300, 5, Floor(10.0, 0.4), (90.0, 20.0))
    text = "\n".join(lines)
    assert "the OpenTelemetry exporter's 90.0 us per span, tiergate's (gateway.telemetry.otlp_wire) 20.0 us per " \
           "span (4.5x less)" in text
    assert "+3.0%" in lines[3] and "+15.0%" in lines[4]  # the % of off column
    assert lines[4].endswith("2300   +15.0%")  # calls per request, and their added share of off's 2000
    verdicts = {line.split(":")[0].strip(): line for line in lines if "RPS target" in line}
    assert "RPS target (<= 5%) met" in verdicts["metrics"] and "p50 target (<= 0.1 ms) met" in verdicts["metrics"]
    assert "RPS target (<= 5%) NOT met" in verdicts["traced"] and "p50 target (<= 0.1 ms) NOT met" in verdicts["traced"]
    assert "RPS target (<= 5%) met" in verdicts["traced@0.1"]
    # the floor of the variant recording the most: 2 spans x 10 us + 26 attributes x 0.4 us per request
    assert "traced records 2.00 spans and 26.0 attributes per request -> 30.4 us = 3.0% of off" in text


def test_encoding_cost_measures_both_encoders() -> None:
    from gateway.bench.obs_cost import encoding_cost

    sdk, wire = encoding_cost(spans=32, rounds=1)
    assert sdk > 0 and wire > 0


def test_sdk_floor_measures_a_span_and_an_attribute() -> None:
    from gateway.bench.obs_cost import sdk_floor

    floor = sdk_floor(spans=800, rounds=1, attributes=4)
    assert floor.span_us > 0 and floor.attribute_us >= 0
    assert floor.per_request(2, 0) == 2 * floor.span_us
