"""The HF baseline of `tiergate bench engine` runs the engine's computation: plain greedy decoding,
even when the checkpoint's generation config asks HF for a repetition penalty (the demo model's
does: 1.05), which HF's ``generate`` applies to greedy decoding too. And the engine's decode rate is
only taken once every prompt is in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.bench import engine_decode_tokens_per_s, hf_greedy
from engine.engine import LLMEngine
from engine.model import load_model
from tests.engine.hf_tiny import build_hf_model, save_hf_model


@torch.inference_mode()
def _argmax_loop(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.slow  # transformers' generate, 6 x 24 steps
def test_hf_baseline_is_plain_greedy_whatever_the_generation_config_says() -> None:
    model = build_hf_model("mixtral", seed=0).eval()
    model.generation_config.repetition_penalty = 3.0  # a checkpoint's setting, as the demo's 1.05
    model.generation_config.pad_token_id = 0
    prompts = [[5, 9, 5, 9, 5, 9, 12], [1, 2, 3, 4, 5, 6, 7, 8], [40, 40, 40, 41]]
    diverged = 0
    for prompt in prompts:
        plain = _argmax_loop(model, prompt, 24)
        assert hf_greedy(model, prompt, 24) == plain
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            penalised = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                       min_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        diverged += penalised != plain
    assert diverged > 0  # the config's penalty does change HF's greedy tokens: the override matters


def test_the_decode_rate_refuses_requests_that_end_before_every_prompt_is_in(tmp_path: Path) -> None:
    """Two 8-token prompts a step: the first ones' 3 tokens are out before the last prompt is prefilled, so a clock
    started then would time a tail, not a decode (it once looped forever waiting for them to finish again)."""
    model, config = load_model(save_hf_model(build_hf_model("mixtral", seed=1), tmp_path))
    engine = LLMEngine(model, config, eos_token_ids=(), block_size=4, num_blocks=64, max_num_seqs=8,
                       max_num_batched_tokens=16, enable_prefix_caching=False)
    prompts = [[i + 1] * 8 for i in range(8)]
    with pytest.raises(ValueError, match="before every prompt was prefilled"):
        engine_decode_tokens_per_s(engine, prompts, 3)
    roomy = LLMEngine(model, config, eos_token_ids=(), block_size=4, num_blocks=64, max_num_seqs=8,
                      max_num_batched_tokens=64, enable_prefix_caching=False)
    assert engine_decode_tokens_per_s(roomy, prompts, 3) > 0  # every prompt in one step
