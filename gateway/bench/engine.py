"""`tiergate bench engine`: the local engine vs HF transformers, memory-bandwidth use, batching
scale-up, k=1 vs the trained k, (e) q8_0 / q4_0 weights vs the engine's bf16 and the engine vs llama.cpp
on the same GGUF files, speculative decoding (f) and the prefix cache (g). The measurements live in
engine.bench / engine.bench_quant / engine.bench_llamacpp / engine.bench_spec; this picks the sizes and
prices (g)'s tokens with the ledger's own rule."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path

PARTS = ("a", "b", "c", "d", "e", "f", "g")


def run(*, quick: bool, threads: int | None, decode_tokens: int | None, repeats: int, demo: Path,
        data_dir: Path, ppl_windows: int, skip_random: bool, echo: Callable[[str], None],
        draft: Path | None = None, only: Collection[str] = PARTS, config: Path | None = None,
        quantization: bool = True, prefill_tokens: int = 256, llama_cpp: bool = True,
        llama_cpp_threads: Collection[int] = (1, 2), llama_cpp_rounds: int = 5,
        llama_cpp_models: Collection[str] = ("random", "demo")) -> None:
    import torch

    from engine.bench import (
        QUICK,
        BenchSizes,
        run_expert_count_bench,
        run_long_context_bench,
        run_prefix_cache_bench,
        run_random_moe_bench,
    )
    from engine.bench_llamacpp import run_llama_cpp_bench
    from engine.bench_quant import run_quantization_bench
    from engine.bench_spec import run_speculative_bench

    unknown = set(only) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown bench parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if set(llama_cpp_models) - {"random", "demo"}:
        raise ValueError(f"unknown llama.cpp models {sorted(set(llama_cpp_models) - {'random', 'demo'})}; "
                         f"choose from random, demo")
    if threads:
        torch.set_num_threads(threads)
    sizes = QUICK if quick else BenchSizes()
    if decode_tokens:
        sizes = replace(sizes, decode_tokens=decode_tokens)
    if not skip_random and set(only) & {"a", "b", "c", "d"}:
        run_random_moe_bench(sizes, echo, repeats=repeats)
    if "c" in only:
        run_long_context_bench(demo, echo, context_tokens=240 if quick else 960, decode_tokens=sizes.decode_tokens,
                               repeats=repeats)
    if set(only) & {"a", "d"}:
        run_expert_count_bench(demo, data_dir, echo, decode_tokens=sizes.decode_tokens * 2,
                               ppl_windows=ppl_windows, repeats=repeats)
    if quantization and "e" in only:
        run_quantization_bench(sizes, demo, echo, prefill_tokens=prefill_tokens, repeats=repeats,
                               skip_random=skip_random)
    if llama_cpp and "e" in only:
        if not quantization:
            echo("(e) the engine vs llama.cpp on the same weights")
        run_llama_cpp_bench(sizes, demo, echo, threads=sorted(llama_cpp_threads), rounds=llama_cpp_rounds,
                            prefill_tokens=prefill_tokens,
                            models=[m for m in ("random", "demo") if m in llama_cpp_models and
                                    not (m == "random" and skip_random)])
    if "f" in only:
        echo("(f) speculative decoding, batch 1, greedy (machine shared: figures are noisy)")
        run_speculative_bench(demo, draft, echo, decode_tokens=sizes.decode_tokens * (3 if quick else 4),
                              repeats=repeats)
    if "g" in only:
        row = run_prefix_cache_bench(demo, echo, repeats=repeats)
        if row is not None:
            _price_prefix_hit(row.prompt_tokens, row.cached_tokens, demo, config, echo)


def _price_prefix_hit(prompt_tokens: int, cached_tokens: int, demo: Path, config: Path | None,
                      echo: Callable[[str], None]) -> None:
    """(g)'s cost as the ledger books it: the model's configured price, cached tokens at ``cached_input``."""
    from gateway.money import format_usd
    from gateway.settings import ConfigError, load_settings

    try:
        settings = load_settings(config)
    except ConfigError as err:
        echo(f"(g) ledger cost skipped: {err}")
        return
    for name, model in settings.models.items():
        if model.provider == "local" and (Path(settings.base_dir) / model.model).resolve() == demo.resolve():
            price = model.price
            hit = price.nanos(prompt_tokens, cached_tokens, 1)
            cold = price.nanos(prompt_tokens, 0, 1)
            echo(f"(g) ledger cost of that request on {name} (input {price.input}, cached_input "
                 f"{price.cached_input}, output {price.output} USD/1M): {format_usd(hit)} with {cached_tokens} cached "
                 f"tokens vs {format_usd(cold)} cold -> {hit / cold:.0%}")
            return
    echo(f"(g) ledger cost skipped: no local model in the config points at {demo}")
