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

Must not import the scheduler, runner, sampling, or anything web/db; torch and engine model modules (and
engine.native, the decode kernels) only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine import native
from engine.attention import AttentionContext, PagedPlan, causal_attention, paged_attention, plan_paged
from engine.config import ModelConfig
from engine.kernels import linear
from engine.moe import DenseMLP, ExpertCount, SparseMoeBlock, resolve_experts_per_token
from engine.norm import RMSNorm
from engine.rope import RotaryEmbedding, apply_rotary, compute_inv_freq

KVCache = tuple[torch.Tensor, torch.Tensor]


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
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        if plan is not None and plan.decode_only and self._native_decode(qkv, kv_cache):
            assert kv_cache is not None
            q = native.rope_write_kv(qkv, self.n_q, self.n_kv, self.head_dim, cos, sin, kv_cache[0], kv_cache[1],
                                     plan.ctx.slot_mapping)
            o = native.paged_decode(q, kv_cache[0], kv_cache[1], plan.ctx.block_tables, plan.ctx.context_lens,
                                    self.scale, self.window)
            return linear(o.view(*lead, self.n_q * self.head_dim), self.o_proj.weight, self.o_proj.bias)
        if self.qk_norm is None:  # rotate q and k heads together: one rotary pass per layer
            if self.clip_qkv is not None:
                qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
            qk = apply_rotary(qkv[..., : self.split_sizes[0] + self.split_sizes[1]].view(*lead, -1, self.head_dim),
                              cos, sin)
            q, k = qk.split([self.n_q, self.n_kv], dim=-2)
            v = qkv[..., -self.split_sizes[2] :].view(*lead, self.n_kv, self.head_dim)
        else:
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
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if plan is not None:
            assert kv_cache is not None
            o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], plan, self.scale, self.window)
        else:
            o = causal_attention(q, k, v, self.scale, self.window)
        return linear(o.reshape(*lead, self.n_q * self.head_dim), self.o_proj.weight, self.o_proj.bias)


    def _native_decode(self, qkv: torch.Tensor, kv_cache: KVCache | None) -> bool:
        """Decode steps of plain layers (no q/k norm or clipping) rotate, cache and attend in `engine.native`."""
        return (
            self.qk_norm is None
            and self.clip_qkv is None
            and kv_cache is not None
            and qkv.dim() == 2
            and not (torch.is_grad_enabled() and qkv.requires_grad)
            and native.paged_decode_ok(qkv, kv_cache[0], kv_cache[1])
            and native.available()
        )


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp: SparseMoeBlock | DenseMLP
        if config.layer_is_sparse(layer_idx):
            self.mlp = SparseMoeBlock(
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

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> list[KVCache]:
        """One (k_cache, v_cache) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        cfg = self.config
        dtype = dtype or self.lm_head.weight.dtype
        device = device or self.lm_head.weight.device
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        return [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)
        ]

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext | None = None,
        kv_caches: list[KVCache] | None = None,
        experts_per_token: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [..., T, H] (same leading shape as input_ids)."""
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
        caches = kv_caches if plan is not None and kv_caches else None
        if plan is not None and plan.decode_only and caches and h.dim() == 2 and self._fused_residual(h):
            layers = self._native_decode_layers(caches)
            if layers is not None:
                norm = self.model.norm
                return native.decode_layers(
                    layers, h, cos, sin, plan.ctx.slot_mapping, plan.ctx.block_tables, plan.ctx.context_lens,
                    caches[0][0].shape[1], count.k_max if count else 0, count.per_token if count else None,
                    norm.weight, norm.eps)
        if self._fused_residual(h):
            return self._fused_layers(h, cos, sin, plan, caches, count)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, plan, caches[i] if caches else None, count)
        return self.model.norm(h)

    def _fused_residual(self, h: torch.Tensor) -> bool:
        return (
            h.dtype == torch.float32
            and h.device.type == "cpu"
            and not (torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in self.parameters())))
            and self.model.norm.weight.dtype == torch.float32
            and native.available()
        )

    def _native_decode_layers(self, caches: list[KVCache]) -> native.DecodeLayers | None:
        """The layers as one native decode call, or None where a layer has a part it does not cover (q/k norm,
        clipping, a shared expert, an unpacked weight). Built once per set of KV cache tensors."""
        key = tuple(k.data_ptr() for k, _ in caches)
        cached: tuple[tuple[int, ...], native.DecodeLayers | None] | None = getattr(self, "_tg_decode_layers", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        built = self._build_decode_layers(caches)
        self._tg_decode_layers = (key, built)
        return built

    def _build_decode_layers(self, caches: list[KVCache]) -> native.DecodeLayers | None:
        specs: list[native.LayerSpec] = []
        keep: list[torch.Tensor] = []

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            keep.append(t)
            return t.data_ptr()

        element: set[bool] = set()

        def packed(weight: torch.Tensor) -> int | None:
            p = getattr(weight, "_tg_packed", None)
            if p is None:
                return None
            element.add(p.bf16)
            return ptr(p.data)

        for layer, (k_cache, v_cache) in zip(self.model.layers, caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if (attn.qk_norm is not None or attn.clip_qkv is not None or norms[0].eps != norms[1].eps
                    or not all(t.dtype == torch.float32 and t.is_contiguous() for t in (k_cache, v_cache))):
                return None
            spec = native.LayerSpec(
                input_norm=ptr(norms[0].weight), post_norm=ptr(norms[1].weight), eps=norms[0].eps,
                qkv=packed(attn.qkv_proj.weight), qkv_bias=ptr(attn.qkv_proj.bias), o=packed(attn.o_proj.weight),
                o_bias=ptr(attn.o_proj.bias), n_q=attn.n_q, n_kv=attn.n_kv, head_dim=attn.head_dim,
                window=attn.window or 0, scale=attn.scale, k_cache=ptr(k_cache), v_cache=ptr(v_cache))
            if isinstance(mlp, SparseMoeBlock):
                if mlp.shared_expert is not None:
                    return None
                spec.router = ptr(mlp.gate.weight.contiguous())
                spec.gate_up, spec.down = packed(mlp.experts.gate_up_proj), packed(mlp.experts.down_proj)
                spec.num_experts = mlp.num_experts
                spec.moe_intermediate = mlp.experts.down_proj.shape[-1]
                spec.normalize = int(mlp.normalize_topk)
                if not (spec.gate_up and spec.down):
                    return None
            else:
                spec.mlp_gate_up, spec.mlp_down = packed(mlp.gate_up_proj.weight), packed(mlp.down_proj.weight)
                spec.mlp_gate_up_bias, spec.mlp_down_bias = ptr(mlp.gate_up_proj.bias), ptr(mlp.down_proj.bias)
                spec.mlp_intermediate = mlp.down_proj.weight.shape[-1]
                if not (spec.mlp_gate_up and spec.mlp_down):
                    return None
            if not (spec.qkv and spec.o) or len(element) != 1:
                return None  # something unpacked, or fp32 and bf16 panels mixed
            spec.bf16 = int(element.pop())
            specs.append(spec)
        return native.DecodeLayers(specs, keep)

    def _fused_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: PagedPlan | None,
                      caches: list[KVCache] | None, count: ExpertCount | None) -> torch.Tensor:
        """The same layers with each residual add fused into the RMSNorm that follows it (vLLM style): the
        residual stream ``h`` is updated in place and each sub-block's output is added on the next norm."""
        shape = h.shape
        residual = h.reshape(-1, shape[-1])
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            first, second = layer.input_layernorm, layer.post_attention_layernorm
            x = native.add_rmsnorm(residual, delta, first.weight, first.eps).view(shape)
            attn = layer.self_attn(x, cos, sin, plan, caches[i] if caches else None)
            x = native.add_rmsnorm(residual, attn.reshape(residual.shape), second.weight, second.eps)
            delta = layer.mlp(x, count).reshape(residual.shape)
        final = self.model.norm
        return native.add_rmsnorm(residual, delta, final.weight, final.eps).view(shape)

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

    def use_decode_layout(self, release: bool = True) -> None:
        """Lay the weights out for fast inference; names and shapes stay as they are.

        With the native kernels (`engine.native`, fp32 CPU): every matrix the forward multiplies by
        (attention, dense MLPs, the stacked experts, an untied LM head) is repacked into the kernels'
        panel layout, attached to its parameter as ``_tg_packed``, and prefill and decode both run on
        it. With ``release`` the row-major storage is then given back, so the weights are held once: the
        parameter keeps its shape but reads as zeros and is marked ``_tg_released``, every parameter stops
        requiring gradients, and anything but fp32 inference through this model raises rather than
        computing with the released storage. Routers, norms and the
        embedding table (and an LM head tied to it) stay as they are. ``TIERGATE_ENGINE_NATIVE=0`` turns
        all of this off.

        Without them: matrices are re-laid column-major (same values, still trainable), since CPU GEMV
        at batch 1 reads `x @ W_t` with a contiguous `W_t` faster than row-major `F.linear`.
        """
        self.__dict__.pop("_tg_decode_layers", None)  # packed pointers change: rebuild the native decode layers
        embedding = self.model.embed_tokens.weight
        routers = {id(layer.mlp.gate.weight) for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)}
        packable = (
            native.available() and self.lm_head.weight.dtype == torch.float32 and self.lm_head.weight.device.type == "cpu"
        )
        def packs(p: torch.Tensor) -> bool:
            return (p.dim() in (2, 3) and id(p) not in routers and p.shape[-2] >= 16
                    and not (p is embedding and p is not self.lm_head.weight))

        with torch.no_grad():
            # bf16 panels when that loses nothing (a bf16 checkpoint loaded as fp32): half the bytes per step
            bf16 = packable and all(torch.equal(p, p.bfloat16().float()) for p in self.parameters()
                                    if packs(p) and not getattr(p, "_tg_released", False))
            for p in self.parameters():
                if p is embedding and p is not self.lm_head.weight:
                    continue  # looked up by row: column-major would make each row hidden_size strided reads
                if packable:
                    if getattr(p, "_tg_released", False):
                        continue  # packed already; its values live only in the packed copy
                    if packs(p):
                        p._tg_packed = native.pack(p.data, bf16=bf16)  # type: ignore[attr-defined]
                        if release and p is not embedding:
                            p.data = torch.zeros(1, dtype=p.dtype, device=p.device).expand(p.shape)
                            p._tg_released = True  # type: ignore[attr-defined]
                elif p.dim() == 2 and p.stride(-1) == 1:
                    p.data = p.data.t().contiguous().t()
                elif p.dim() == 3 and p.stride(-1) == 1:
                    p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)
        if packable and release:
            self.requires_grad_(False)  # an inference model now: nothing in it can be trained

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
    decode_layout: bool = True,
) -> tuple[CausalLM, ModelConfig]:
    """Build the model for `model_dir/config.json` and load its safetensors weights (HF names).

    The model comes back in eval mode; with `decode_layout` its matrices are re-laid for fast batch-1
    decode (see `CausalLM.use_decode_layout`)."""
    from engine.weights import load_hf_weights  # weights imports model types; keep the cycle one-way

    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rotary()
    load_hf_weights(model, model_dir)
    if decode_layout:
        model.use_decode_layout()
    model.eval()
    return model, config
