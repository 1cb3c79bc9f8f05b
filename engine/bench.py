"""The engine benchmark behind `tiergate bench engine`: every figure is a ratio against a
baseline measured in the same run.

(a) batch-1 decode tokens/s of `LLMEngine` vs HF transformers ``generate`` on the same
    weights, dtype and thread count;
(b) achieved weight-read bandwidth (bytes of weights a decode step must read: attention,
    router, the active experts, the LM head) as a fraction of the machine's memory
    bandwidth measured here with a large tensor reduction;
(c) aggregate decode tokens/s at 1, 4 and 16 concurrent streams;
(d) on the bundled demo model: decode speed and held-out perplexity at k=1 vs the trained k;
(f) speculative decoding: in `engine.bench_spec`;
(g) prefix cache: time to first token of a 1,000-token prompt sharing 90% with an earlier one
    vs a cold one.

Imports torch and the engine; transformers (a dev dependency) only inside the HF baseline.
Nothing web/db.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.bench_traffic import (
    decode_weight_bytes,
    expert_share,
    products_ceiling,
    shared_weight_bytes,
    step_weight_bytes,
)
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

Log = Callable[[str], None]


@dataclass(frozen=True)
class BenchSizes:
    """A random Mixtral-style MoE; the default is ~200M parameters."""

    hidden: int = 768
    layers: int = 8
    heads: int = 12
    kv_heads: int = 4
    experts: int = 8
    top_k: int = 2
    expert_intermediate: int = 1280
    vocab: int = 8192
    prompt_tokens: int = 16
    decode_tokens: int = 32
    streams: tuple[int, ...] = (1, 4, 16)


QUICK = BenchSizes(hidden=256, layers=4, heads=8, kv_heads=4, experts=8, top_k=2, expert_intermediate=512,
                   vocab=4096, decode_tokens=16)


def build_random_moe(sizes: BenchSizes, out_dir: Path, seed: int = 0) -> Any:
    """A random HF ``MixtralForCausalLM`` (fp32, eval) saved to ``out_dir``; returns the HF model."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.MixtralConfig(vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=sizes.expert_intermediate,
                           num_hidden_layers=sizes.layers, num_attention_heads=sizes.heads,
                           num_key_value_heads=sizes.kv_heads, num_local_experts=sizes.experts,
                           num_experts_per_tok=sizes.top_k, max_position_embeddings=1024,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = tf.MixtralForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out_dir)
    return model


def build_random_dense(sizes: BenchSizes, out_dir: Path, seed: int = 0) -> Any:
    """A random HF ``LlamaForCausalLM`` with the MoE's active shape: its MLP is as wide as the top-k experts
    together, so one token reads the same weight bytes as one token of the MoE."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=sizes.vocab, hidden_size=sizes.hidden,
                         intermediate_size=sizes.expert_intermediate * sizes.top_k, num_hidden_layers=sizes.layers,
                         num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads,
                         max_position_embeddings=1024, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out_dir)
    return model


def stream_rates(engine: LLMEngine, sizes: BenchSizes, repeats: int) -> dict[int, float]:
    """Aggregate decode tokens/s at each of ``sizes.streams`` concurrent streams (best of ``repeats``, the stream
    counts taking turns: their ratios compare runs under the same load)."""
    return best_interleaved({streams: partial(engine_decode_tokens_per_s, engine,
                                              _prompts(streams, sizes.prompt_tokens, sizes.vocab, streams),
                                              sizes.decode_tokens) for streams in sizes.streams}, repeats)


def _bench_engine(model: Any, config: Any, sizes: BenchSizes) -> LLMEngine:
    most = max(sizes.streams)
    return LLMEngine(model, config, eos_token_ids=(), max_model_len=sizes.prompt_tokens + sizes.decode_tokens + 8,
                     max_num_seqs=most, max_num_batched_tokens=max(512, most * sizes.prompt_tokens),
                     enable_prefix_caching=False, release_weights=True)


def working_set_ceilings(bandwidth: Callable[[float], float], one_bytes: float, many_bytes: float, most: int,
                         achieved: float, ceiling: float, products: tuple[float, float, float, float]) -> str:
    """Part (c)'s ceilings again, each step's weight bytes read at the streaming rate a buffer of that size
    gets on this machine (``bandwidth(gib)``: the backend's best streaming read). The two ceilings above read
    both steps' bytes at one bandwidth; where the caches hold a good share of one stream's weights (part
    (b) above 1.0: a 264 MB model in a large L3) one stream reads faster than the memory streams, and the
    bigger working set of ``most`` streams cannot. Where both working sets outgrow the caches the two
    rates agree and these ceilings are the ones above. ``products``: (the bytes every token reads, the
    multiply-add rate the dense control reached, one stream's achieved bytes/s, its tokens/s), for the
    second ceiling's model with the ``most``-stream bytes at one stream's efficiency of its own rate."""
    shared, macs, streamed, one = products
    rate_one, rate_many = bandwidth(one_bytes / (1 << 30)), bandwidth(many_bytes / (1 << 30))
    traffic = ceiling * rate_many / rate_one
    roof = products_ceiling(most, shared, many_bytes, macs, streamed * rate_many / rate_one, one)
    return (f"    at each step's own working set (best streaming read of a buffer that size here: "
            f"{one_bytes / 1e6:.0f} MB {rate_one / 1e9:.1f} GB/s, {many_bytes / 1e6:.0f} MB {rate_many / 1e9:.1f} GB/s): "
            f"weight-traffic ceiling {traffic:.2f}x, achieved {achieved / traffic:.0%} of it (target >= 90%: "
            f"{_verdict(achieved / traffic, 0.9)}); with the {most}-token products as above {roof:.2f}x, "
            f"achieved {achieved / roof:.0%}")


def engine_tokens_per_s(engine: LLMEngine, prompts: list[list[int]], n: int, k: int | None = None) -> float:
    """Aggregate generated tokens/s for ``prompts`` run concurrently to ``n`` tokens each (incl. prefill)."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params, experts_per_token=k)
    elapsed = time.perf_counter() - start
    assert all(o.num_output_tokens == n for o in outs)
    return len(prompts) * n / elapsed


def engine_decode_tokens_per_s(engine: LLMEngine, prompts: list[list[int]], n: int,
                               k: int | None = None) -> float:
    """Aggregate tokens/s of the decode phase only: the clock starts once every prompt is prefilled."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ids = {engine.add_request(p, params, k) for p in prompts}
    started: set[str] = set()
    while started != ids:
        outs = engine.step()
        started.update(o.request_id for o in outs)
        if any(o.finished for o in outs):  # its n tokens out before the last prompt was in: not a decode rate
            raise ValueError(f"a request finished its {n} tokens before every prompt was prefilled; ask for more "
                             f"tokens or a larger max_num_batched_tokens")
    start = time.perf_counter()
    done = 0
    while done < len(ids):
        done += sum(o.finished for o in engine.step())
    return len(ids) * (n - 1) / (time.perf_counter() - start)


# The HF baseline runs the engine's computation: plain greedy, n tokens. A checkpoint's
# generation_config.json may carry decoding settings that HF's generate applies even when greedy
# (the demo model's sets repetition_penalty 1.05, which changed HF's tokens on 2 of 5 prompts);
# they are overridden here, so the two sides compute the same tokens.
HF_GREEDY: dict[str, Any] = {"do_sample": False, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                             "temperature": None, "top_p": None, "top_k": None}


@torch.inference_mode()
def hf_greedy(hf_model: Any, prompt: list[int], n: int) -> list[int]:
    """HF transformers' ``generate``: ``n`` plain greedy tokens after ``prompt``."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            **HF_GREEDY)
    assert out.shape[1] == len(prompt) + n
    return [int(t) for t in out[0, len(prompt):]]


def hf_tokens_per_s(hf_model: Any, prompt: list[int], n: int) -> float:
    start = time.perf_counter()
    hf_greedy(hf_model, prompt, n)
    return n / (time.perf_counter() - start)


def best_interleaved(measures: dict[Any, Callable[[], float]], repeats: int) -> dict[Any, float]:
    """Best of ``repeats`` for each measure, taking turns, so a burst of load on a shared
    machine hits every side of a comparison alike rather than one of them."""
    best = {key: 0.0 for key in measures}
    for _ in range(repeats):
        for key, measure in measures.items():
            best[key] = max(best[key], measure())
    return best


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(count)]


def _verdict(value: float, target: float, higher: bool = True) -> str:
    ok = value >= target if higher else value <= target
    return "meets target" if ok else "BELOW target"


def run_random_moe_bench(sizes: BenchSizes, log: Log, repeats: int = 3) -> None:
    """Parts (a), (b), (c) on one random MoE saved in HF format and loaded by our engine."""
    from engine.model import load_model

    log(f"threads={torch.get_num_threads()} dtype=float32")
    with tempfile.TemporaryDirectory(prefix="tiergate-bench-") as tmp:
        hf = build_random_moe(sizes, Path(tmp))
        model, config = load_model(tmp)
    total, active = model.parameter_counts()
    log(f"random MoE: {total / 1e6:.1f}M parameters, {active / 1e6:.1f}M active per token "
        f"({sizes.experts} experts, top-{sizes.top_k}, {sizes.layers} layers, hidden {sizes.hidden})")
    engine = _bench_engine(model, config, sizes)
    log(f"engine: {engine.runner.backend.describe()}")
    prompt = _prompts(1, sizes.prompt_tokens, sizes.vocab, 0)[0]
    n = sizes.decode_tokens
    engine_tokens_per_s(engine, [prompt], 4)  # warm-up
    hf_tokens_per_s(hf, prompt, 4)
    pair = best_interleaved({"ours": lambda: engine_tokens_per_s(engine, [prompt], n),
                             "hf": lambda: hf_tokens_per_s(hf, prompt, n)}, repeats)
    ours, theirs = pair["ours"], pair["hf"]
    log(f"(a) batch-1 generation ({sizes.prompt_tokens}-token prompt, {n} new tokens): engine {ours:.1f} tok/s, HF transformers generate {theirs:.1f} tok/s "
        f"-> ratio {ours / theirs:.2f}x (target >= 2x: {_verdict(ours / theirs, 2.0)})")

    bandwidth = engine.runner.backend.memory_bandwidth()
    step_bytes = decode_weight_bytes(config, sizes.top_k)
    steps = max(engine_decode_tokens_per_s(engine, [prompt], n) for _ in range(repeats))
    achieved = step_bytes * steps
    log(f"(b) weights read per decode step {step_bytes / 1e6:.1f} MB x {steps:.1f} decode steps/s = "
        f"{achieved / 1e9:.2f} GB/s; measured memory bandwidth (best streaming read of 1 GiB) {bandwidth / 1e9:.2f} GB/s "
        f"-> fraction {achieved / bandwidth:.2f} (target >= 0.50: {_verdict(achieved / bandwidth, 0.5)})")

    rates = stream_rates(engine, sizes, repeats)
    one = rates[min(rates)]
    parts = ", ".join(f"{s} streams {r:.1f} tok/s ({r / one:.2f}x)" for s, r in rates.items())
    most = max(rates)
    top = rates[most] / one
    many_bytes = step_weight_bytes(config, sizes.top_k, most)
    ceiling = most * step_weight_bytes(config, sizes.top_k, 1) / many_bytes
    log(f"(c) aggregate decode tokens/s (after prefill): {parts} -> {most} vs 1 stream ratio {top:.2f}x "
        f"(target >= 6x: {_verdict(top, 6.0)})")
    log(f"    weight traffic: {most} streams read ~{many_bytes / 1e6:.0f} MB per "
        f"step (every expert a token picked) vs {step_bytes / 1e6:.0f} MB for 1 -> ceiling {ceiling:.2f}x at equal "
        f"bandwidth; achieved {top / ceiling:.0%} of it")
    with tempfile.TemporaryDirectory(prefix="tiergate-bench-") as tmp:
        build_random_dense(sizes, Path(tmp))
        dense, dense_config = load_model(tmp)
    dense_rates = stream_rates(_bench_engine(dense, dense_config, sizes), sizes, repeats)
    dense_top = dense_rates[most] / dense_rates[min(dense_rates)]
    log(f"    control, a dense model of the same active shape ({dense.parameter_counts()[0] / 1e6:.1f}M parameters, "
        f"every stream reads the same weights): " + ", ".join(
            f"{s} streams {r:.1f} tok/s ({r / dense_rates[min(dense_rates)]:.2f}x)" for s, r in dense_rates.items())
        + f" -> {most} vs 1 stream ratio {dense_top:.2f}x")
    # The weights every token reads are read once a step, but at 16 tokens their products are bound by the FMAs,
    # not by memory: a second ceiling takes them at the multiply-add rate the dense control reached (its products
    # all have 16 tokens; fp32, a multiply-add a weight and token) and the rest at one stream's bandwidth.
    macs = dense_rates[most] * decode_weight_bytes(dense_config, sizes.top_k) / 4
    streamed = step_bytes * one  # one stream's weight bytes a second
    shared = shared_weight_bytes(config, sizes.top_k)
    roof = products_ceiling(most, shared, many_bytes, macs, streamed, one)
    log(f"    with the {most}-token products over the weights every token reads ({shared / 1e6:.0f} MB: attention, "
        f"router, LM head) at the multiply-add rate the dense control reached ({macs / 1e9:.0f} G/s) and the rest "
        f"at one stream's {streamed / 1e9:.1f} GB/s: ceiling {roof:.2f}x; achieved {top / roof:.0%} of it")
    log(working_set_ceilings(engine.runner.backend.memory_bandwidth, step_bytes, many_bytes, most, top, ceiling,
                             (shared, macs, streamed, one)))

    speed = best_interleaved({k: partial(engine_decode_tokens_per_s, engine, [prompt], n, k) for k in (1, sizes.top_k)},
                             repeats)
    ratio = speed[1] / speed[sizes.top_k]
    bound = decode_weight_bytes(config, sizes.top_k) / decode_weight_bytes(config, 1)
    log(f"(d) same random MoE, batch-1 decode k=1 {speed[1]:.1f} tok/s vs k={sizes.top_k} {speed[sizes.top_k]:.1f} "
        f"tok/s -> speed ratio {ratio:.2f}x (target >= 1.5x: {_verdict(ratio, 1.5)}); weight bytes per token "
        f"{bound:.2f}x fewer at k=1 (the ceiling; {ratio / bound:.0%} of it)")


def _hf_on_demo(engine: LLMEngine, demo_dir: Path, prompt: list[int], n: int, log: Log, repeats: int) -> None:
    """(a) again on the demo model's real weights: our batch-1 decode vs HF ``generate``."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    hf_tokens_per_s(hf, prompt, 4)
    pair = best_interleaved({"ours": lambda: engine_tokens_per_s(engine, [prompt], n),
                             "hf": lambda: hf_tokens_per_s(hf, prompt, n)}, repeats)
    ours, theirs = pair["ours"], pair["hf"]
    streamed = engine.runner.backend.weight_format
    if streamed == "bf16 panels":
        streamed += ", exact: the checkpoint is bf16"
    log(f"(a) demo model batch-1 decode, fp32 compute (weights streamed as {streamed}): engine {ours:.1f} tok/s, "
        f"HF transformers generate (fp32) {theirs:.1f} tok/s "
        f"-> ratio {ours / theirs:.2f}x (target >= 2x: {_verdict(ours / theirs, 2.0)})")


def run_expert_count_bench(demo_dir: Path, data_dir: Path, log: Log, *, decode_tokens: int = 64,
                           ppl_windows: int | None = 8, repeats: int = 3) -> None:
    """Part (d): k=1 vs the trained k on the bundled demo model."""
    if not (demo_dir / "config.json").is_file():
        log(f"(d) skipped: no demo model at {demo_dir} (train it with `tiergate engine train`)")
        return
    engine = LLMEngine.from_dir(demo_dir, enable_prefix_caching=False)
    trained = engine.default_experts_per_token
    if trained is None or trained == 1:
        log(f"(d) skipped: the demo model's trained k is {trained}; nothing to compare")
        return
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Explain why the sky is blue."}])
    engine_tokens_per_s(engine, [prompt], 4, 1)
    speed = best_interleaved({k: partial(engine_tokens_per_s, engine, [prompt], decode_tokens, k)
                              for k in (1, trained)}, repeats)
    # the decode steps alone, as the random MoE's (d) and the per-step ceiling count them: the prefill of the
    # short prompt runs the general forward, whose fixed costs k hardly moves, and is a third of the time above
    decode = best_interleaved({k: partial(engine_decode_tokens_per_s, engine, [prompt], decode_tokens, k)
                               for k in (1, trained)}, repeats)
    _hf_on_demo(engine, demo_dir, prompt, decode_tokens, log, repeats)
    from engine.train import checkpoint_perplexity

    if not data_dir.is_dir():
        log(f"(d) perplexity skipped: no data folder at {data_dir}")
        ppl: dict[int | None, float] = {}
    else:
        ppl = checkpoint_perplexity(demo_dir, data_dir, [1, trained], max_windows=ppl_windows)
    ratio = decode[1] / decode[trained]
    bound = decode_weight_bytes(engine.config, trained) / decode_weight_bytes(engine.config, 1)
    line = (f"(d) demo model k=1 {speed[1]:.1f} tok/s vs k={trained} {speed[trained]:.1f} tok/s with the prefill "
            f"({speed[1] / speed[trained]:.2f}x); decode steps alone k=1 {decode[1]:.1f} tok/s vs k={trained} "
            f"{decode[trained]:.1f} tok/s -> speed ratio {ratio:.2f}x (target >= 1.5x: {_verdict(ratio, 1.5)}; "
            f"ceiling {bound:.2f}x: its experts are {expert_share(engine.config, trained):.0%} of the weight bytes "
            f"a token reads; {ratio / bound:.0%} of it)")
    if ppl:
        change = ppl[1] / ppl[trained] - 1
        line += (f"; held-out perplexity k=1 {ppl[1]:.3f} vs k={trained} {ppl[trained]:.3f} -> "
                 f"{100 * change:+.1f}% (target <= +10%: {_verdict(change, 0.10, higher=False)})")
    log(line)


def run_long_context_bench(demo_dir: Path, log: Log, *, context_tokens: int = 960, streams: int = 16,
                           decode_tokens: int = 32, repeats: int = 3) -> None:
    """Part (c) at long contexts: the demo model decoding ``streams`` sequences of ``context_tokens`` each against
    one, where a step's K/V rows (read from memory every step) outweigh its weights (which stay in cache)."""
    if not (demo_dir / "config.json").is_file():
        log(f"(c) long contexts skipped: no demo model at {demo_dir}")
        return
    engine = LLMEngine.from_dir(demo_dir, enable_prefix_caching=False, max_num_seqs=streams,
                                max_model_len=context_tokens + decode_tokens + 8,
                                max_num_batched_tokens=streams * context_tokens)  # every prompt in one step
    cfg, vocab = engine.config, engine.config.vocab_size
    rates = best_interleaved({n: partial(engine_decode_tokens_per_s, engine, _prompts(n, context_tokens, vocab, n),
                                         decode_tokens) for n in (1, streams)}, repeats)
    kv = streams * (context_tokens + decode_tokens // 2) * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        engine.runner.kv_caches[0][0][0, 0, 0].nbytes)  # one head's row of one slot (K; V the same)
    log(f"(c) long contexts: demo model, {streams} streams at ~{context_tokens}-token contexts {rates[streams]:.1f} "
        f"tok/s vs 1 stream {rates[1]:.1f} tok/s ({rates[streams] / rates[1]:.2f}x); a {streams}-stream step reads "
        f"~{kv / 1e6:.0f} MB of K/V ({kv * rates[streams] / streams / 1e9:.1f} GB/s)")


# -- (g) prefix cache -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixCacheRow:
    prompt_tokens: int
    cached_tokens: int
    ttft_warm_s: float
    ttft_cold_s: float

    @property
    def ratio(self) -> float:
        return self.ttft_warm_s / self.ttft_cold_s


def _ttft(engine: LLMEngine, prompt: list[int], salt: str) -> tuple[float, int]:
    start = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                          cache_salt=salt)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def run_prefix_cache_bench(demo_dir: Path, log: Log, *, prompt_tokens: int = 1000, shared: float = 0.9,
                           repeats: int = 3) -> PrefixCacheRow | None:
    """Part (g): time to first token of a prompt sharing ``shared`` of its tokens with an earlier one (same
    tenant) vs a cold prompt of the same length. Fresh random prompts each round, so cold is cold."""
    if not (demo_dir / "config.json").is_file():
        log(f"(g) skipped: no demo model at {demo_dir}")
        return None
    engine = LLMEngine.from_dir(demo_dir)
    prompt_tokens = min(prompt_tokens, engine.limits.max_model_len - 1)
    vocab = engine.config.vocab_size
    keep = int(prompt_tokens * shared)
    _ttft(engine, _prompts(1, prompt_tokens, vocab, seed=99)[0], "warm-up")
    warm, cold, cached = float("inf"), float("inf"), 0
    for r in range(repeats):
        base, tail, other = _prompts(3, prompt_tokens, vocab, seed=1000 + r)
        _ttft(engine, base, "tenant")  # the earlier request: fills the cache
        t, cached = _ttft(engine, base[:keep] + tail[keep:], "tenant")
        warm = min(warm, t)
        cold = min(cold, _ttft(engine, other, "tenant")[0])
    row = PrefixCacheRow(prompt_tokens, cached, warm, cold)
    log(f"(g) prefix cache: time to first token on a {prompt_tokens}-token prompt sharing {shared:.0%} with an "
        f"earlier one {1e3 * warm:.1f} ms ({cached} tokens cached) vs cold {1e3 * cold:.1f} ms -> "
        f"{row.ratio:.0%} of cold (target <= 20%: {_verdict(row.ratio, 0.20, higher=False)})")
    return row
