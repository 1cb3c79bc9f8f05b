"""The optional int8 KV cache: each head's K/V row stored as int8 with its fp32 scale, dequantized on read.
Quantization error is bounded, more blocks fit the same bytes, and an engine on it decodes like the fp32
cache within that error (the same greedy tokens until a near-tie flips, logprobs close), on the native and
the torch backends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention import dequantize_kv, quantize_kv
from engine.engine import EngineError, LLMEngine
from engine.model import load_model
from engine.sampling import SamplingParams
from tests.engine.hf_tiny import build_hf_model, save_hf_model

PROMPTS = [[(7 * i + 3 * j) % 150 + 5 for j in range(3 + 5 * i)] for i in range(4)]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_model(Path(save_hf_model(build_hf_model("qwen3_moe", seed=4), tmp_path_factory.mktemp("q3"))))


def test_quantize_roundtrip_error_is_within_half_a_step() -> None:
    x = torch.randn(50, 4, 24) * torch.rand(50, 4, 1) * 10
    packed = quantize_kv(x)
    assert packed.dtype == torch.int8 and packed.shape == (50, 4, 28)
    back = dequantize_kv(packed)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 + 1e-6).all()
    assert dequantize_kv(x) is x  # float caches pass through


def test_int8_cache_holds_more_blocks_in_the_same_bytes(tiny: Any) -> None:
    model, config = tiny
    fp32 = LLMEngine(model, config, eos_token_ids=(), kv_cache_bytes=1 << 20, max_num_seqs=64)
    int8 = LLMEngine(model, config, eos_token_ids=(), kv_cache_bytes=1 << 20, max_num_seqs=64, kv_dtype=torch.int8)
    assert int8.limits.num_blocks >= 3 * fp32.limits.num_blocks
    assert int8.runner.kv_caches[0][0].dtype == torch.int8
    with pytest.raises(EngineError):
        LLMEngine(model, config, kv_dtype=torch.int16)


def _run(engine: LLMEngine, params: SamplingParams, **kw: Any) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens per prompt and every chosen token's logprob, collected step by step."""
    ids = [engine.add_request(p, params, **kw) for p in PROMPTS]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    lps: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            lps[o.request_id] += [lp.logprob for lp in o.new_logprobs]
    return [tokens[i] for i in ids], [lps[i] for i in ids]


@pytest.mark.parametrize("native", [True, False])
def test_int8_cache_decodes_like_fp32(tiny: Any, native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.native import ops
    from engine.runner import TorchBackend

    model, config = tiny
    if not native:
        monkeypatch.setattr(ops, "available", lambda: False)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=True)
    kw: dict = dict(eos_token_ids=(), block_size=4, num_blocks=64, max_num_batched_tokens=16)
    ref_engine = LLMEngine(model, config, **kw)
    engine = LLMEngine(model, config, kv_dtype=torch.int8, **kw)
    assert isinstance(engine.runner.backend, TorchBackend) != native
    ref_tokens, ref_lps = _run(ref_engine, params)
    tokens, lps = _run(engine, params, speculative="prompt_lookup")
    common, diffs = 0, []
    for got, ref, got_lp, ref_lp in zip(tokens, ref_tokens, lps, ref_lps, strict=True):
        n = 0
        while n < len(ref) and got[n] == ref[n]:  # until a near-tie flips (then the contexts differ)
            diffs.append(abs(got_lp[n] - ref_lp[n]))
            n += 1
        common += n
    assert common >= 0.75 * 12 * len(PROMPTS)
    assert 0 < max(diffs) < 0.05  # int8 error is there, and small
