"""The HF baseline of `tiergate bench engine` runs the engine's computation: plain greedy decoding,
even when the checkpoint's generation config asks HF for a repetition penalty (the demo model's
does: 1.05), which HF's ``generate`` applies to greedy decoding too."""

from __future__ import annotations

import pytest
import torch

from engine.bench import hf_greedy
from tests.engine.hf_tiny import build_hf_model


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
