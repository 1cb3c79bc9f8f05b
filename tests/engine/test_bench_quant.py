"""Part (e) of `tiergate bench engine`: every scheme gets a decode and a prefill row with its ratio to the
engine's bf16 panels in the same run (no speed is asserted: machines here are shared)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.bench import BenchSizes
from engine.bench_quant import run_quantization_bench

DEMO = Path(__file__).resolve().parents[2] / "engine" / "models" / "demo-moe"
ROW = r"· {scheme}\s+\((?P<fmt>[^)]*)\): decode [\d.]+ tok/s \((?P<d>[\d.]+)x\), prefill \d+ tok/s \((?P<p>[\d.]+)x\)"


@pytest.mark.slow  # a random MoE (transformers) and the demo model, three schemes each
def test_quantization_rows() -> None:
    torch.set_num_threads(1)
    lines: list[str] = []
    sizes = BenchSizes(hidden=64, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, expert_intermediate=64,
                       vocab=512, decode_tokens=4)
    run_quantization_bench(sizes, DEMO, lines.append, prefill_tokens=32, repeats=1)
    out = "\n".join(lines)
    assert out.startswith("(e) weight-only quantization")
    for label in ("random MoE", "demo-moe"):
        rows = {s: re.search(rf"{label}.*" + ROW.format(scheme=s), out) for s in ("none", "q8_0", "q4_0")}
        assert all(rows.values()), out
        none, q8, q4 = rows["none"], rows["q8_0"], rows["q4_0"]
        assert none is not None and q8 is not None and q4 is not None
        assert none["fmt"] == "bf16 panels" and none["d"] == "1.00" and none["p"] == "1.00"
        assert q8["fmt"] == "q8_0 blocks" and q4["fmt"] == "q4_0 + q8_0 blocks"
