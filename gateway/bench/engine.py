"""`tiergate bench engine`: the local engine vs HF transformers, memory-bandwidth use, batching
scale-up, k=1 vs the trained k, and (e) q8_0 / q4_0 weights vs the engine's bf16. The measurements live in engine.bench; this picks the sizes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path


def run(*, quick: bool, threads: int | None, decode_tokens: int | None, repeats: int, demo: Path,
        data_dir: Path, ppl_windows: int, skip_random: bool, echo: Callable[[str], None],
        quantization: bool = True, prefill_tokens: int = 256) -> None:
    import torch

    from engine.bench import QUICK, BenchSizes, run_expert_count_bench, run_random_moe_bench
    from engine.bench_quant import run_quantization_bench

    if threads:
        torch.set_num_threads(threads)
    sizes = QUICK if quick else BenchSizes()
    if decode_tokens:
        sizes = replace(sizes, decode_tokens=decode_tokens)
    if not skip_random:
        run_random_moe_bench(sizes, echo, repeats=repeats)
    run_expert_count_bench(demo, data_dir, echo, decode_tokens=sizes.decode_tokens * 2,
                           ppl_windows=ppl_windows, repeats=repeats)
    if quantization:
        run_quantization_bench(sizes, demo, echo, prefill_tokens=prefill_tokens, repeats=repeats,
                               skip_random=skip_random)
