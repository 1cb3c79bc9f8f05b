"""`tiergate bench engine --quick` end to end: every figure of the issue is printed as a ratio against a
baseline measured in the same run, with its target verdict (no speed is asserted: machines here are shared)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.process, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_bench_engine_quick_prints_every_figure(tmp_path: Path) -> None:
    """Without a llama.cpp build (TIERGATE_LLAMA_CPP names an empty folder) the side by side says so."""
    done = subprocess.run(
        [sys.executable, "-c", "from gateway.cli import main; main()", "bench", "engine", "--quick", "--threads", "1",
         "--repeats", "1", "--ppl-windows", "1", "--decode-tokens", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "TIERGATE_LLAMA_CPP": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for figure in (r"\(a\) batch-1 generation .* ratio [\d.]+x \(target >= 2x: (meets|BELOW) target\)",
                   r"\(b\) weights read per decode step .* fraction [\d.]+ \(target >= 0.50",
                   r"\(c\) aggregate decode tokens/s .* 16 vs 1 stream ratio [\d.]+x",
                   r"\(c\) long contexts: demo model, 16 streams at ~240-token contexts [\d.]+ tok/s vs 1 stream .* MB of K/V",
                   r"weight traffic: 16 streams read ~\d+ MB per step .* ceiling [\d.]+x",
                   r"control, a dense model of the same active shape .* 16 vs 1 stream ratio [\d.]+x",
                   r"at the multiply-add rate the dense control reached \(\d+ G/s\) .* ceiling [\d.]+x; achieved \d+%",
                   r"at each step's own working set \(best streaming read of a buffer that size here: \d+ MB [\d.]+ GB/s, "
                   r"\d+ MB [\d.]+ GB/s\): weight-traffic ceiling [\d.]+x, achieved \d+% of it \(target >= 90%: "
                   r"(meets|BELOW) target\); with the 16-token products as above [\d.]+x, achieved \d+%",
                   r"\(d\) same random MoE, batch-1 decode k=1 .* speed ratio [\d.]+x",
                   r"\(a\) demo model batch-1 decode, fp32 compute .* ratio [\d.]+x",
                   r"\(d\) demo model k=1 .* ceiling [\d.]+x.* held-out perplexity k=1 [\d.]+ vs k=2 [\d.]+",
                   r"\(e\) weight-only quantization",
                   r"random MoE .* q8_0 \(q8_0 blocks\): decode [\d.]+ tok/s \([\d.]+x\), prefill \d+ tok/s",
                   r"demo-moe · q4_0 \(q4_0 \+ q8_0 blocks\): decode [\d.]+ tok/s \([\d.]+x\)",
                   r"llama.cpp side by side: skipped \(TIERGATE_LLAMA_CPP=" + re.escape(str(tmp_path)) + " holds no llama-bench"):
        assert re.search(figure, out), f"missing {figure!r} in:\n{out}"


def test_bench_engine_speculative_and_prefix_cache_parts() -> None:
    """(f) and (g) alone: every proposer on both workloads against plain decoding in the same run, with
    acceptance, the verify-cost curve, the cost bound and prompt lookup's ceiling; the prefix-cache TTFT ratio
    and its ledger price."""
    done = subprocess.run(
        [sys.executable, "-c", "from gateway.cli import main; main()", "bench", "engine", "--quick", "--threads", "1",
         "--repeats", "1", "--decode-tokens", "8", "--only", "f,g"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for workload in ("copy-heavy", "free generation"):
        assert re.search(rf"\(f\) {workload}: plain decoding [\d.]+ tok/s .* verify step by draft length", out), out
        assert re.search(rf"\(f\) {workload}: \d+% of the answers' 4-grams occur in their prompt; prompt lookup's "
                         r"next-token guess is right at \d+%", out), out
        assert re.search(rf"\(f\) {workload}: prompt lookup's ceiling, .* [\d.]+x; it reached \d+% of that", out), out
        for mode in ("prompt_lookup", "draft", "self"):
            assert re.search(rf"\(f\) {workload}, {mode}: [\d.]+ tok/s -> ratio [\d.]+x vs plain .* acceptance "
                             r"\d+%, [\d.]+ tokens/verify; .* bound [\d.]+x .* reached \d+%", out), f"{workload}/{mode}:\n{out}"
    assert re.search(r"\(g\) prefix cache: .* 1000-token prompt sharing 90% .* \((\d+) tokens cached\) vs cold "
                     r"[\d.]+ ms -> \d+% of cold", out), out
    assert re.search(r"\(g\) ledger cost of that request on demo-moe .* with \d+ cached tokens vs [\d.]+ cold", out), out
    bad = subprocess.run([sys.executable, "-c", "from gateway.cli import main; main()", "bench", "engine",
                          "--only", "z"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode != 0 and "unknown bench parts" in bad.stderr
