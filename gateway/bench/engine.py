"""`tiergate bench engine`: the local engine vs HF transformers, memory-bandwidth use, batching
scale-up and k=1 vs the trained k. The measurements live in engine.bench; this picks the sizes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path


def run(*, quick: bool, threads: int | None, decode_tokens: int | None, repeats: int, demo: Path,
        data_dir: Path, ppl_windows: int, skip_random: bool, echo: Callable[[str], None]) -> None:
    import torch

    from engine.bench import QUICK, BenchSizes, run_expert_count_bench, run_random_moe_bench

    if threads:
        torch.set_num_threads(threads)
    sizes = QUICK if quick else BenchSizes()
    if decode_tokens:
        sizes = replace(sizes, decode_tokens=decode_tokens)
    if not skip_random:
        run_random_moe_bench(sizes, echo, repeats=repeats)
    run_expert_count_bench(demo, data_dir, echo, decode_tokens=sizes.decode_tokens * 2,
                           ppl_windows=ppl_windows, repeats=repeats)
