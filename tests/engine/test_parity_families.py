"""Parity with HF transformers for every family: prefill logits, paged decode logits, 32 greedy tokens.

Each test builds a random tiny HF model, saves it with `save_pretrained`, loads it with `engine.load_model`,
and checks (fp32): prefill logits vs HF, every decode step's logits vs HF `generate`'s logits, identical
greedy tokens for 32 steps, and paged-cache decoding vs full recomputation (`ctx=None`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model import load_model
from tests.engine.hf_tiny import FAMILIES, PagedSequences, build_hf_model

STEPS = 32


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    rel = (actual - expected).norm() / expected.norm()
    assert rel < 1e-4, f"relative error {rel:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf_prefill_decode_and_greedy(family: str, tmp_path: Path) -> None:
    hf = build_hf_model(family, seed=1)
    hf.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.model_type == family

    torch.manual_seed(2)
    prompt = torch.randint(0, config.vocab_size, (11,))
    with torch.inference_mode():
        hf_out = hf.generate(
            prompt[None],
            max_new_tokens=STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        hf_prefill = hf(prompt[None]).logits[0]
    hf_tokens = hf_out.sequences[0, len(prompt) :].tolist()
    assert len(hf_tokens) == STEPS

    seqs = PagedSequences(num_blocks=32, block_size=4, seed=3)
    kv = model.allocate_kv_cache(32, 4)
    with torch.inference_mode():
        # no-cache path (the oracle) agrees with HF on the whole prompt
        _close(model(prompt, torch.arange(len(prompt))), hf_prefill)
        ctx, positions = seqs.step({0: len(prompt)})
        logits = model(prompt, positions, ctx, kv)
        _close(logits, hf_prefill)
        tokens = prompt.tolist()
        ours: list[int] = []
        for step in range(STEPS):
            step_logits = logits[-1]
            _close(step_logits, hf_out.logits[step][0])
            recomputed = model(torch.tensor(tokens), torch.arange(len(tokens)))[-1]
            _close(step_logits, recomputed)
            nxt = int(step_logits.argmax())
            ours.append(nxt)
            tokens.append(nxt)
            ctx, positions = seqs.step({0: 1})
            logits = model(torch.tensor([nxt]), positions, ctx, kv)
    assert ours == hf_tokens


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_scaling_variants_match_hf(rope: dict[str, object], tmp_path: Path) -> None:
    # max_position_embeddings=16 < prompt length, so dynamic NTK actually rescales
    hf = build_hf_model("llama", seed=4, rope_parameters=dict(rope), max_position_embeddings=16)
    hf.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.rope.rope_type == rope["rope_type"]
    prompt = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        _close(model(prompt, torch.arange(len(prompt))), hf(prompt[None]).logits[0])


def test_legacy_rope_scaling_field_is_read(tmp_path: Path) -> None:
    """Hub checkpoints written before transformers 5 carry `rope_theta` + `rope_scaling` at the top level."""
    import json

    from engine.config import ModelConfig

    hf = build_hf_model("llama", seed=6)
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.rope == ModelConfig.from_dir(tmp_path).rope
