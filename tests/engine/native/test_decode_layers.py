"""The one-call decode kernel (`tg_decode_layers`) layer by layer against the torch `DecoderLayer`.

For every layer kind the kernel covers — a Mixtral-style MoE layer (renormalised top-k), Qwen2-MoE/OLMoE-style
routing (no renormalisation) with a per-token expert count, a Llama-style dense SwiGLU layer with attention
and MLP biases, a Qwen2-style dense layer with a sliding window, and a MoE layer streamed from bf16 panels —
one decode step of three sequences with cached context (GQA, scattered blocks) must give the torch layer's
residual stream, its final-normed output and the same K/V written to the cache, on one thread and on two
(sizes chosen so that the expert and MLP products do split across two threads). `one_call_gap` must send
everything else (q/k norms, clipping, a shared expert, two norm epsilons) to the per-op path.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from engine.attention import plan_paged
from engine.config import ModelConfig
from engine.model import CausalLM, DecoderLayer
from engine.moe import ExpertCount
from engine.native import layers, ops
from engine.native.packing import PackedWeights
from tests.engine.hf_tiny import PagedSequences

BASE = ModelConfig(model_type="mixtral", vocab_size=64, hidden_size=256, intermediate_size=1536, num_hidden_layers=1,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-5)
MOE: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, sparse_layers=(True,))
KINDS: dict[str, tuple[ModelConfig, ExpertCount | None]] = {
    "mixtral_moe": (replace(BASE, **MOE, norm_topk_prob=True), ExpertCount(2)),
    "unnormalised_moe_per_token_k": (replace(BASE, **MOE, norm_topk_prob=False),
                                     ExpertCount(3, torch.tensor([1, 3, 2]))),
    "llama_dense_biases": (replace(BASE, model_type="llama", qkv_bias=True, o_bias=True, mlp_bias=True), None),
    "qwen2_dense_window": (replace(BASE, model_type="qwen2", qkv_bias=True, sliding_window=6,
                                   sliding_layers=(True,)), None),
    "mixtral_moe_bf16_panels": (replace(BASE, **MOE, norm_topk_prob=True), ExpertCount(2)),
}
CONTEXT = {0: 5, 1: 17, 2: 11}  # tokens already cached per sequence before the decode step
BLOCK = 4


def _model(config: ModelConfig, seed: int, bf16: bool = False) -> CausalLM:
    """A one-layer model with spread-out weights (biases, norms around 1); bf16-exact weights with ``bf16``."""
    torch.manual_seed(seed)
    model = CausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
            if bf16:
                p.copy_(p.bfloat16().float())
    return model.eval()


def _decode_step(model: CausalLM, count: ExpertCount | None, seed: int) -> dict[str, torch.Tensor]:
    """One decode step through `tg_decode_layers` and through the torch layer, from the same cache."""
    cfg = model.config
    layer = model.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    seqs = PagedSequences(num_blocks=24, block_size=BLOCK, seed=seed)
    seqs.step(CONTEXT)  # the cached context: blocks handed out, K/V filled in below
    ctx, positions = seqs.step({s: 1 for s in CONTEXT})
    gen = torch.Generator().manual_seed(seed)
    cache = [torch.randn(24, BLOCK, cfg.num_key_value_heads, cfg.head_dim, generator=gen) for _ in range(2)]
    h = torch.randn(len(CONTEXT), cfg.hidden_size, generator=gen)
    cos, sin = model.model.rotary_emb(positions, torch.float32)
    norm = model.model.norm

    packed = PackedWeights(model, release=False)
    assert layers.one_call_gap(layer, packed) is None
    c_cache = [t.clone() for t in cache]
    keep: list[torch.Tensor] = []
    spec = layers.layer_spec(layer, packed, c_cache[0], c_cache[1], keep)
    c_h = h.clone()
    c_out = ops.decode_layers(ops.DecodeLayers([spec], keep), c_h, cos, sin, ctx.slot_mapping, ctx.block_tables,
                              ctx.context_lens, BLOCK, count.k_max if count else 0,
                              count.per_token if count else None, norm.weight, norm.eps)

    t_cache = (cache[0].clone(), cache[1].clone())
    with torch.inference_mode():
        t_h = layer(h, cos, sin, plan_paged(ctx, BLOCK), t_cache, count)
        t_out = norm(t_h)
    return {"h": c_h, "out": c_out, "k": c_cache[0], "v": c_cache[1],
            "torch_h": t_h, "torch_out": t_out, "torch_k": t_cache[0], "torch_v": t_cache[1]}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_one_call_layer_equals_the_torch_layer(kind: str, threads: int) -> None:
    config, count = KINDS[kind]
    bf16 = kind.endswith("bf16_panels")
    model = _model(config, seed=len(kind), bf16=bf16)
    assert PackedWeights(model, release=False).bf16 == bf16
    got = _decode_step(model, count, seed=threads)
    for name in ("h", "out", "k", "v"):
        torch.testing.assert_close(got[name], got[f"torch_{name}"], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.equal(got["h"], got["out"])  # the final norm was applied to the residual stream


@pytest.mark.parametrize("kind", ["mixtral_moe", "llama_dense_biases"])
def test_one_call_layer_is_the_same_on_one_and_two_threads(kind: str) -> None:
    config, count = KINDS[kind]
    model = _model(config, seed=7)
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(_decode_step(model, count, seed=3))
    finally:
        torch.set_num_threads(before)
    for name in ("h", "out", "k", "v"):
        assert torch.equal(results[0][name], results[1][name]), name


def test_the_window_and_the_expert_count_change_the_result() -> None:
    """The layer tests above can fail: a window cuts keys, and tokens asking for one expert differ from k=3."""
    windowed, _ = KINDS["qwen2_dense_window"]
    model = _model(windowed, seed=1)
    unwindowed = _model(replace(windowed, sliding_window=None, sliding_layers=()), seed=1)
    assert not torch.allclose(_decode_step(model, None, 0)["out"], _decode_step(unwindowed, None, 0)["out"])
    moe, mixed = KINDS["unnormalised_moe_per_token_k"]
    model = _model(moe, seed=2)
    assert not torch.allclose(_decode_step(model, mixed, 0)["out"], _decode_step(model, ExpertCount(3), 0)["out"])


@pytest.mark.parametrize(("change", "gap"), [
    (dict(qk_norm="head"), "q/k norm"),
    (dict(clip_qkv=3.0), "q/k/v clipping"),
    (dict(**MOE, shared_expert_intermediate_size=64), "a shared expert"),
])
def test_layers_outside_the_one_call_path_say_why(change: dict[str, Any], gap: str) -> None:
    model = _model(replace(BASE, **change), seed=0)
    layer = model.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    packed = PackedWeights(model, release=False)
    assert layers.one_call_gap(layer, packed) == gap
    caches = model.allocate_kv_cache(4, BLOCK)
    assert layers.decode_layers(model, packed, caches) is None


def test_two_norm_epsilons_leave_the_one_call_path() -> None:
    model = _model(BASE, seed=0)
    layer = model.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    layer.post_attention_layernorm.eps = 1e-6
    assert layers.one_call_gap(layer, PackedWeights(model, release=False)) == "two norm epsilons"
