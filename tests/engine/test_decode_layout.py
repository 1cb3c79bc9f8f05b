"""`load_model`'s decode layout: projections column-major, an untied embedding table kept row-major (looked up
by row), a tied one column-major for the LM head; values unchanged either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model import load_model
from tests.engine.hf_tiny import build_hf_model


@pytest.mark.parametrize("tied", [False, True])
def test_decode_layout_strides_and_values(tied: bool, tmp_path: Path) -> None:
    build_hf_model("qwen2", seed=8, tie_word_embeddings=tied).save_pretrained(tmp_path)
    fast, _ = load_model(tmp_path)
    plain, _ = load_model(tmp_path, decode_layout=False)
    embedding = fast.model.embed_tokens.weight
    assert (fast.lm_head.weight is embedding) == tied
    assert embedding.stride() == ((1, embedding.shape[0]) if tied else (embedding.shape[1], 1))
    assert fast.model.layers[0].self_attn.qkv_proj.weight.stride(0) == 1
    for (name, a), (_, b) in zip(fast.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.tensor([3, 1, 4, 1, 5])
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids, torch.arange(5)), plain(ids, torch.arange(5)), rtol=1e-5, atol=1e-5)
