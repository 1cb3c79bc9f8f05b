"""Which decoder layers the one-call decode kernel (`tg_decode_layers`) covers, and their `LayerSpec`s.

`tg_decode_layers` runs a whole decode step in C: per layer RMSNorm (+ the previous residual), the packed
QKV product (+ bias), RoPE and the cache write, paged attention (GQA, a sliding window), the packed o
product (+ bias), RMSNorm (+ residual), then either the MoE block (softmax router, top-k with a per-token
k, optional renormalisation, SwiGLU experts: Mixtral, Qwen3-MoE, OLMoE-style routing) or a dense SwiGLU
MLP (+ biases: Llama, Qwen2); finally the model's norm. `one_call_gap` says why a layer is outside that
(q/k norms, q/k/v clipping, a shared expert, an unpacked matrix, two different norm epsilons, matrices
in more than one weight format); such
layers run per op in `engine.native.backend`. `decode_layers` builds the spec array for a model and its
KV cache, or None when some layer is not covered.

Must not import the scheduler, the runner, or anything web/db; torch, the engine's model types and
engine.native only.
"""

from __future__ import annotations

import torch

from engine.model import CausalLM, DecoderLayer, KVCache
from engine.moe import SparseMoeBlock
from engine.native import ops
from engine.native.packing import PackedWeights


def one_call_gap(layer: DecoderLayer, packed: PackedWeights) -> str | None:
    """Why `tg_decode_layers` cannot run ``layer`` (None: it can)."""
    attn, mlp = layer.self_attn, layer.mlp
    if attn.qk_norm is not None:
        return "q/k norm"
    if attn.clip_qkv is not None:
        return "q/k/v clipping"
    if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
        return "two norm epsilons"
    if packed.get(attn.qkv_proj.weight) is None or packed.get(attn.o_proj.weight) is None:
        return "an attention matrix too small to pack"
    if isinstance(mlp, SparseMoeBlock):
        if mlp.shared_expert is not None:
            return "a shared expert"
        if packed.get(mlp.experts.gate_up_proj) is None:
            return "experts too small to pack"
    elif packed.get(mlp.gate_up_proj.weight) is None or packed.get(mlp.down_proj.weight) is None:
        return "an MLP matrix too small to pack"
    if len({p.fmt for p in _layer_packed(layer, packed)}) != 1:
        return "weights in more than one format"
    return None


def _layer_packed(layer: DecoderLayer, packed: PackedWeights) -> list[ops.Packed]:
    attn, mlp = layer.self_attn, layer.mlp
    weights = [attn.qkv_proj.weight, attn.o_proj.weight]
    if isinstance(mlp, SparseMoeBlock):
        weights += [mlp.experts.gate_up_proj, mlp.experts.down_proj]
    else:
        weights += [mlp.gate_up_proj.weight, mlp.down_proj.weight]
    return [p for w in weights if (p := packed.get(w)) is not None]


def cache_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The C kernels index the cache as contiguous fp32 CPU [blocks, block_size, Hkv, D]."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in (k_cache, v_cache))


def layer_spec(layer: DecoderLayer, packed: PackedWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
               keep: list[torch.Tensor]) -> ops.LayerSpec:
    """``layer`` (covered: see `one_call_gap`) as a `LayerSpec` over its packed weights and KV cache; every
    tensor the spec points into is appended to ``keep``."""

    def ptr(t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        keep.append(t)
        return t.data_ptr()

    def panels(weight: torch.Tensor) -> int | None:
        p = packed.get(weight)
        return None if p is None else ptr(p.data)

    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    spec = ops.LayerSpec(
        input_norm=ptr(norms[0].weight), post_norm=ptr(norms[1].weight), eps=norms[0].eps,
        fmt=_layer_packed(layer, packed)[0].fmt,
        qkv=panels(attn.qkv_proj.weight), qkv_bias=ptr(attn.qkv_proj.bias), o=panels(attn.o_proj.weight),
        o_bias=ptr(attn.o_proj.bias), n_q=attn.n_q, n_kv=attn.n_kv, head_dim=attn.head_dim,
        window=attn.window or 0, scale=attn.scale, k_cache=ptr(k_cache), v_cache=ptr(v_cache))
    if isinstance(mlp, SparseMoeBlock):
        spec.router = ptr(mlp.gate.weight.contiguous())
        spec.gate_up, spec.down = panels(mlp.experts.gate_up_proj), panels(mlp.experts.down_proj)
        spec.num_experts = mlp.num_experts
        spec.moe_intermediate = mlp.experts.intermediate_size
        spec.normalize = int(mlp.normalize_topk)
    else:
        spec.mlp_gate_up, spec.mlp_down = panels(mlp.gate_up_proj.weight), panels(mlp.down_proj.weight)
        spec.mlp_gate_up_bias, spec.mlp_down_bias = ptr(mlp.gate_up_proj.bias), ptr(mlp.down_proj.bias)
        spec.mlp_intermediate = mlp.down_proj.weight.shape[-1]
    return spec


def decode_layers(model: CausalLM, packed: PackedWeights, caches: list[KVCache]) -> ops.DecodeLayers | None:
    """Every layer of ``model`` over ``caches`` for one `tg_decode_layers` call, or None where a layer is not
    covered or the cache is not laid out as the kernel reads it."""
    keep: list[torch.Tensor] = []
    specs: list[ops.LayerSpec] = []
    for layer, (k_cache, v_cache) in zip(model.model.layers, caches, strict=True):
        assert isinstance(layer, DecoderLayer)
        if one_call_gap(layer, packed) is not None or not cache_ok(k_cache, v_cache):
            return None
        specs.append(layer_spec(layer, packed, k_cache, v_cache, keep))
    return ops.DecodeLayers(specs, keep)
