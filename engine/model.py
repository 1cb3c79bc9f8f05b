"""The decoder-only causal LM shared by every supported family (Mixtral, Qwen2/3-MoE, OLMoE, Llama, Qwen2).

Module names follow HF (`model.layers.N.self_attn.o_proj`, `model.layers.N.mlp.gate`, ...) except where
weights are fused for speed: `self_attn.qkv_proj` (q, k, v rows in that order), `mlp.gate_up_proj` (gate rows
first) and `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` stacked as [E, ...]. `engine.weights` maps
HF checkpoints onto these names.

`CausalLM.forward(input_ids, positions, ctx, kv_caches, experts_per_token)`:
- with `ctx` (an `AttentionContext`) and `kv_caches`: a flattened batch of T new tokens from B sequences,
  K/V written to and read from the paged cache (prefill, decode or mixed);
- with `ctx=None`: full causal attention over one sequence `[T]` (or a batch `[B, T]`) with no cache — the
  recomputation oracle and the training path (differentiable).

This is the plain model: the oracle, the training path, and what the runner's torch backend runs. The
native fast path (`engine.native`) is built from it by the runner and is not woven in here.

Pure torch: must not import engine.native, the scheduler, runner, sampling, or anything web/db; torch and
the engine's model modules only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.attention import (
    AttentionContext,
    PagedPlan,
    causal_attention,
    kv_row_width,
    paged_attention,
    plan_paged,
)
from engine.config import ModelConfig
from engine.kernels import linear
from engine.moe import DenseMLP, ExpertCount, SparseMoeBlock, build_sparse_moe, resolve_experts_per_token
from engine.norm import RMSNorm
from engine.quant import QuantizedWeights, check_scheme, quantize_model
from engine.rope import RotaryEmbedding, apply_rotary, compute_inv_freq

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StepInputs:
    """The start of a forward: h [..., T, H] embedded tokens, cos / sin [..., T, D], the paged plan (None
    without a cache) and the expert count (None for a dense model)."""

    h: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    plan: PagedPlan | None
    count: ExpertCount | None


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.n_q = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.window = config.layer_window(layer_idx)
        self.clip_qkv = config.clip_qkv
        self.qk_norm = None if config.qk_norm == "none" else config.qk_norm
        q_size, kv_size = self.n_q * self.head_dim, self.n_kv * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        elif config.qk_norm == "full":
            self.q_norm = RMSNorm(q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(kv_size, config.rms_norm_eps)

    @property
    def plain(self) -> bool:
        """No q/k norm and no clipping: q and k are the projection's rows, rotated."""
        return self.qk_norm is None and self.clip_qkv is None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: PagedPlan | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        """x [..., T, H] -> [..., T, H]."""
        lead = x.shape[:-1]
        q, k, v = self.heads(linear(x, self.qkv_proj.weight, self.qkv_proj.bias), cos, sin)
        if plan is not None:
            assert kv_cache is not None
            o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], plan, self.scale, self.window)
        else:
            o = causal_attention(q, k, v, self.scale, self.window)
        return linear(o.reshape(*lead, self.n_q * self.head_dim), self.o_proj.weight, self.o_proj.bias)

    def heads(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection qkv [..., T, (Hq + 2 Hkv) D] -> q [..., T, Hq, D], k and v [..., T, Hkv, D]:
        clipped, q/k-normed and rotated as the family does it."""
        lead = qkv.shape[:-1]
        if self.qk_norm is None:  # rotate q and k heads together: one rotary pass per layer
            if self.clip_qkv is not None:
                qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
            qk = apply_rotary(qkv[..., : self.split_sizes[0] + self.split_sizes[1]].view(*lead, -1, self.head_dim),
                              cos, sin)
            q, k = qk.split([self.n_q, self.n_kv], dim=-2)
            v = qkv[..., -self.split_sizes[2] :].view(*lead, self.n_kv, self.head_dim)
            return q, k, v
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        if self.qk_norm == "full":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(*lead, self.n_q, self.head_dim)
        k = k.reshape(*lead, self.n_kv, self.head_dim)
        v = v.reshape(*lead, self.n_kv, self.head_dim)
        if self.qk_norm == "head":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp: SparseMoeBlock | DenseMLP
        if config.layer_is_sparse(layer_idx):
            self.mlp = build_sparse_moe(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                config.norm_topk_prob,
                config.shared_expert_intermediate_size,
            )
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: PagedPlan | None,
        kv_cache: KVCache | None,
        count: ExpertCount | None,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, plan, kv_cache)
        x = self.post_attention_layernorm(h)
        return h + self.mlp(x.reshape(-1, x.shape[-1]), count).view_as(x)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Q8_0 / Q4_0 blocks of the matrices held quantized (`engine.quant`); their parameters hold the
        # dequantized values, so this plain model computes the quantized model too
        self.quantized: QuantizedWeights | None = None

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> list[KVCache]:
        """One (k_cache, v_cache) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim]; for an
        int8 cache each row is head_dim int8 values followed by its fp32 scale (see `engine.attention`)."""
        cfg = self.config
        reference = self.model.norm.weight  # never handed over to a backend (see `engine.native`)
        dtype = dtype or reference.dtype
        device = device or reference.device
        shape = (num_blocks, block_size, cfg.num_key_value_heads, kv_row_width(cfg.head_dim, dtype))
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)
        ]

    def step_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext | None = None,
        kv_caches: list[KVCache] | None = None,
        experts_per_token: torch.Tensor | int | None = None,
    ) -> StepInputs:
        """What every layer of a forward shares: the embedded tokens, RoPE, the paged plan and expert count
        (validated here; a fast backend starts from the same values)."""
        cfg = self.config
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        plan: PagedPlan | None = None
        if ctx is not None:
            if kv_caches is None or len(kv_caches) != cfg.num_hidden_layers:
                raise ValueError("a paged forward needs one KV cache pair per layer")
            if input_ids.dim() != 1:
                raise ValueError("a paged forward takes flattened input_ids [T]")
            plan = plan_paged(ctx, kv_caches[0][0].shape[1])
        count: ExpertCount | None = None
        if cfg.is_moe:
            count = resolve_experts_per_token(
                experts_per_token, input_ids.numel(), cfg.num_experts, cfg.num_experts_per_tok
            )
        return StepInputs(h, cos, sin, plan, count)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext | None = None,
        kv_caches: list[KVCache] | None = None,
        experts_per_token: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [..., T, H] (same leading shape as input_ids)."""
        step = self.step_inputs(input_ids, positions, ctx, kv_caches, experts_per_token)
        h = step.h
        caches = kv_caches if step.plan is not None and kv_caches else None
        for i, layer in enumerate(self.model.layers):
            h = layer(h, step.cos, step.sin, step.plan, caches[i] if caches else None, step.count)
        return self.model.norm(h)

    def compute_logits(
        self, hidden: torch.Tensor, last_token_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits for all rows of `hidden` [T, H], or only rows `last_token_indices` (cheap decode)."""
        if last_token_indices is not None:
            hidden = hidden[last_token_indices]
        return linear(hidden, self.lm_head.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext | None = None,
        kv_caches: list[KVCache] | None = None,
        experts_per_token: torch.Tensor | int | None = None,
        last_token_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits [..., T, vocab], or [len(last_token_indices), vocab] when indices are given."""
        hidden = self.hidden_states(input_ids, positions, ctx, kv_caches, experts_per_token)
        return self.compute_logits(hidden, last_token_indices)

    def reset_rotary(self) -> None:
        """Recompute the (non-persistent) RoPE frequencies, e.g. after `to_empty`."""
        cfg = self.config
        rotary = self.model.rotary_emb
        inv_freq, _ = compute_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        rotary.inv_freq = inv_freq.to(self.lm_head.weight.device)

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token at the trained k) parameter counts; tied weights counted once."""
        total = sum(p.numel() for p in self.parameters())
        active = total
        cfg = self.config
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                expert_params = layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
                active -= expert_params - expert_params * cfg.num_experts_per_tok // cfg.num_experts
        return total, active


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    decode_layout: bool | None = None,
    quantization: str = "none",
) -> tuple[CausalLM, ModelConfig]:
    """Build the model for `model_dir/config.json` and load its safetensors weights (HF names), or for a GGUF
    file (`engine.gguf`: its own config, tokenizer and tensors, Q8_0 / Q4_0 kept as blocks).

    ``quantization`` (``none`` | ``q8_0`` | ``q4_0``, see `engine.quant`) quantizes the matrices at load (a
    fp32 ``dtype`` only); the native backend then runs them on its int8 kernels.

    The model comes back plain (pure torch, trainable) in eval mode. The fast inference layout is no
    longer applied here: an `LLMEngine` built on the model lets its runner prepare a backend for it
    (`engine.runner`). ``decode_layout`` is accepted for compatibility and has no effect."""
    from engine.weights import load_hf_weights  # weights imports model types; keep the cycle one-way

    check_scheme(quantization)
    if str(model_dir).endswith(".gguf"):
        from engine.gguf import load_gguf_model

        model, config = load_gguf_model(model_dir, dtype=dtype, device=device)
        if quantization != "none":
            quantize_model(model, quantization)
        return model, config
    if decode_layout is not None:
        warnings.warn("load_model(decode_layout=...) has no effect: the engine's runner lays the weights out for "
                      "decoding", DeprecationWarning, stacklevel=2)
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rotary()
    load_hf_weights(model, model_dir)
    model.eval()
    if quantization != "none":
        quantize_model(model, quantization)
    return model, config
