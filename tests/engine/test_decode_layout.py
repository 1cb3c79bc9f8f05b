"""`load_model`'s decode layout. With the native kernels: every projection (and the stacked experts) is packed
and its row-major storage released (held once), routers and the embedding table keep theirs, and a released
weight refuses any use but fp32 inference. Without them: projections column-major, an untied embedding kept
row-major (looked up by row), a tied one column-major for the LM head. Logits unchanged either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import native
from engine.model import load_model
from engine.weights import hf_state_dict
from tests.engine.hf_tiny import build_hf_model


@pytest.fixture(params=["native", "torch"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        assert native.available(), native.reason()
    else:
        monkeypatch.setattr(native, "available", lambda: False)
    return str(request.param)


@pytest.mark.parametrize("tied", [False, True])
def test_decode_layout_strides_and_values(tied: bool, kernels: str, tmp_path: Path) -> None:
    build_hf_model("qwen2", seed=8, tie_word_embeddings=tied).save_pretrained(tmp_path)
    fast, _ = load_model(tmp_path)
    plain, _ = load_model(tmp_path, decode_layout=False)
    embedding = fast.model.embed_tokens.weight
    assert (fast.lm_head.weight is embedding) == tied
    qkv = fast.model.layers[0].self_attn.qkv_proj.weight
    if kernels == "native":
        assert hasattr(qkv, "_tg_packed") and hasattr(fast.lm_head.weight, "_tg_packed")
        assert hasattr(embedding, "_tg_packed") == tied
        assert qkv._tg_released and qkv.untyped_storage().nbytes() == 4  # held once: in the packed copy
        assert not getattr(embedding, "_tg_released", False) and embedding.is_contiguous()
    else:
        assert not hasattr(qkv, "_tg_packed")
        assert embedding.stride() == ((1, embedding.shape[0]) if tied else (embedding.shape[1], 1))
        assert qkv.stride(0) == 1
    for (name, a), (_, b) in zip(fast.named_parameters(), plain.named_parameters(), strict=True):
        assert a.shape == b.shape, name
        if not getattr(a, "_tg_released", False):
            assert torch.equal(a, b), name
    ids = torch.tensor([3, 1, 4, 1, 5])
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids, torch.arange(5)), plain(ids, torch.arange(5)), rtol=1e-5, atol=1e-5)


def test_moe_routers_stay_unpacked_and_experts_packed(tmp_path: Path) -> None:
    assert native.available(), native.reason()
    build_hf_model("mixtral", seed=3).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    mlp = model.model.layers[0].mlp
    assert not hasattr(mlp.gate.weight, "_tg_packed")
    assert mlp.experts.gate_up_proj._tg_packed.data.shape[0] == mlp.experts.gate_up_proj.shape[0]
    assert hasattr(mlp.experts.down_proj, "_tg_packed")


def test_released_weights_refuse_training_and_other_dtypes(tmp_path: Path) -> None:
    assert native.available(), native.reason()
    build_hf_model("mixtral", seed=2).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    ids = torch.tensor([3, 1, 4])
    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(RuntimeError, match="does not require grad"):
        model(ids, torch.arange(3)).sum().backward()  # nothing left to train
    with pytest.raises(RuntimeError, match="packed inference layout"):
        hf_state_dict(model)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="repacked for inference"):
        model.to(torch.float64)(ids, torch.arange(3))
    trainable, _ = load_model(tmp_path, decode_layout=False)
    trainable(ids, torch.arange(3)).sum().backward()


@pytest.mark.parametrize("family", ["mixtral", "llama"])
def test_a_bf16_checkpoint_packs_to_bf16_panels_and_decodes_the_same(family: str, tmp_path: Path) -> None:
    """Weights that are exact in bf16 (a bf16 checkpoint) stream as bf16 panels: half the bytes, same logits as
    the fp32 computation, through prefill and the one-call decode path."""
    from tests.engine.hf_tiny import PagedSequences

    assert native.available(), native.reason()
    hf = build_hf_model(family, seed=6)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    hf.save_pretrained(tmp_path)
    fast, config = load_model(tmp_path)
    plain, _ = load_model(tmp_path, decode_layout=False)
    assert fast.model.layers[0].self_attn.qkv_proj.weight._tg_packed.bf16
    prompt = torch.randint(0, config.vocab_size, (7,), generator=torch.Generator().manual_seed(1))
    fast_seqs, plain_seqs = PagedSequences(16, 4, seed=2), PagedSequences(16, 4, seed=2)
    fast_kv, plain_kv = fast.allocate_kv_cache(16, 4), plain.allocate_kv_cache(16, 4)
    ids = prompt
    with torch.inference_mode():
        for step in range(6):
            n = len(prompt) if step == 0 else 1
            ctx, pos = fast_seqs.step({0: n})
            got = fast(ids, pos, ctx, fast_kv)[-1]
            ctx, pos = plain_seqs.step({0: n})
            expected = plain(ids, pos, ctx, plain_kv)[-1]
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
            ids = got.argmax()[None]


def test_weights_not_exact_in_bf16_stay_fp32_panels(tmp_path: Path) -> None:
    assert native.available(), native.reason()
    build_hf_model("mixtral", seed=7).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    assert not model.lm_head.weight._tg_packed.bf16
