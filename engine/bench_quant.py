"""Part (e) of `tiergate bench engine`: decode and prefill speed of the quantized weights (``q8_0``, ``q4_0``)
against the engine's own bf16 panels, in the same run, on the same weights.

Each model is loaded once per scheme from a bf16-exact checkpoint (the random bench MoE is rounded to bf16,
the demo model is stored in bf16), so ``none`` streams bf16 panels: the engine's best unquantized format.
Batch-1 decode tokens/s is measured after the prompt is prefilled; prefill tokens/s is one step over a
``prefill_tokens``-token prompt (to its first token). The measures take turns (`best_interleaved`), so a
burst of load on a shared machine hits every scheme alike; the ratio is each scheme over ``none``.

llama.cpp side by side on the same weights is `engine.bench_llamacpp` (the same part, printed after these rows).

Imports torch and the engine; nothing web/db.
"""

from __future__ import annotations

import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.bench import (
    BenchSizes,
    Log,
    _prompts,
    best_interleaved,
    build_random_moe,
    engine_decode_tokens_per_s,
)
from engine.config import ModelConfig
from engine.engine import LLMEngine
from engine.model import load_model
from engine.sampling_params import SamplingParams

SCHEMES = ("none", "q8_0", "q4_0")


def engine_prefill_tokens_per_s(engine: LLMEngine, prompt: list[int]) -> float:
    """Prompt tokens/s of one prefill (the step that yields the first token)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    rid = engine.add_request(prompt, params)
    while not any(o.request_id == rid and o.finished for o in engine.step()):
        pass
    return len(prompt) / (time.perf_counter() - start)


def _engine(model: Any, config: Any, prefill_tokens: int, decode_tokens: int) -> LLMEngine:
    return LLMEngine(model, config, eos_token_ids=(), max_model_len=prefill_tokens + decode_tokens + 8,
                     max_num_seqs=1, max_num_batched_tokens=prefill_tokens, enable_prefix_caching=False,
                     release_weights=True)


def compare_schemes(model_dir: Path, label: str, log: Log, *, prefill_tokens: int, decode_tokens: int,
                    repeats: int, vocab: int) -> dict[str, tuple[float, float]]:
    """Decode and prefill tokens/s per scheme for the checkpoint in ``model_dir``; logs one row per scheme."""
    engines: dict[str, LLMEngine] = {}
    for scheme in SCHEMES:
        model, config = load_model(model_dir, quantization=scheme)
        engines[scheme] = _engine(model, config, prefill_tokens, decode_tokens)
    short = _prompts(1, 16, vocab, 1)[0]
    long = _prompts(1, prefill_tokens, vocab, 2)[0]
    for engine in engines.values():  # warm-up: build the kernels' paths, touch the weights
        engine_decode_tokens_per_s(engine, [short], 4)
        engine_prefill_tokens_per_s(engine, long[: min(64, prefill_tokens)])
    decode = best_interleaved({s: partial(engine_decode_tokens_per_s, e, [short], decode_tokens)
                               for s, e in engines.items()}, repeats)
    prefill = best_interleaved({s: partial(engine_prefill_tokens_per_s, e, long) for s, e in engines.items()}, repeats)
    for scheme, engine in engines.items():
        fmt = engine.runner.backend.weight_format
        log(f"    {label} · {scheme:<4} ({fmt}): decode {decode[scheme]:.1f} tok/s "
            f"({decode[scheme] / decode['none']:.2f}x), prefill {prefill[scheme]:.0f} tok/s "
            f"({prefill[scheme] / prefill['none']:.2f}x)")
    return {s: (decode[s], prefill[s]) for s in SCHEMES}


def run_quantization_bench(sizes: BenchSizes, demo_dir: Path | None, log: Log, *, prefill_tokens: int = 256,
                           repeats: int = 3, skip_random: bool = False) -> None:
    log(f"(e) weight-only quantization on the engine's int8 kernels, batch 1, threads={torch.get_num_threads()}; "
        f"ratio = scheme / the engine's bf16 panels, same run (q4_0 keeps the LM head at q8_0)")
    if not skip_random:
        with tempfile.TemporaryDirectory(prefix="tiergate-bench-") as tmp:
            hf = build_random_moe(sizes, Path(tmp))
            with torch.no_grad():
                for p in hf.parameters():
                    p.copy_(p.bfloat16().float())  # bf16-exact: the unquantized baseline streams bf16 panels
            hf.save_pretrained(tmp)
            del hf
            compare_schemes(Path(tmp), f"random MoE ({sizes.experts} experts top-{sizes.top_k}, hidden "
                            f"{sizes.hidden}, {sizes.layers} layers)", log, prefill_tokens=prefill_tokens,
                            decode_tokens=sizes.decode_tokens, repeats=repeats, vocab=sizes.vocab)
    if demo_dir is not None and (demo_dir / "config.json").is_file():
        vocab = ModelConfig.from_dir(demo_dir).vocab_size
        compare_schemes(demo_dir, "demo-moe", log, prefill_tokens=prefill_tokens,
                        decode_tokens=sizes.decode_tokens * 2, repeats=repeats, vocab=vocab)
