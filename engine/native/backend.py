"""`NativeBackend`: the fp32 CPU fast path, built once from a plain `CausalLM` by `prepare`.

The backend owns the packed weights (`engine.native.packing`) and runs the runner's flattened paged
batches on the C kernels, reading everything else (embedding, RoPE, norms, routers, q/k norms) from the
model it was built from:

- a plain decode step (`decode`: token ids, positions and block tables in, logits out) is one C call from the
  token ids on (`engine.native.step`) where every layer is on the one-call path and the LM head is packed;
- any step whose every layer `tg_decode_layers` covers (`engine.native.layers`) is one C call: a decode step
  one row per sequence, a prefill or mixed step one row per new token with its own context (its position + 1,
  `PagedPlan.per_token`; every row's K/V is written before any row attends, so it is causal);
- any other step runs layer by layer: residual adds fused into the following RMSNorm (vLLM style),
  packed products, the fused MoE kernel, and for decode steps RoPE + cache write and paged attention in
  C (attention with q/k norms or clipping does its head maths in torch first); prefill and mixed steps run
  their attention on the same paged decode kernel, each new token a one-query sequence over the keys up to
  its position (`PagedPlan.per_token`): torch's CPU attention took the math path (a full score matrix, a
  masked softmax), ~half of a 256-token prefill of the demo model. An int8 KV cache keeps torch's paged
  attention.

Inference only: it builds no autograd graph (the runner calls it under `torch.inference_mode`). The runner
picks it (`engine.runner`); nothing else imports this package.

Must not import the scheduler, the runner, or anything web/db; torch, the engine's model modules and
engine.native only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeGuard

import torch
import torch.nn.functional as F

from engine.attention import AttentionContext, PagedPlan, paged_attention, write_kv
from engine.kernels import linear as torch_linear
from engine.model import CausalLM, DecoderLayer, KVCache
from engine.moe import DenseMLP, ExpertCount, SparseMoeBlock, grouped_moe, route
from engine.native import layers as one_call
from engine.native import ops, prefetch
from engine.native.packing import PackedWeights
from engine.native.step import DecodeStep, decode_step


def supports(model: torch.nn.Module) -> TypeGuard[CausalLM]:
    """Whether `prepare` can build a backend for ``model``: a fp32 `CausalLM` on the CPU, kernels built."""
    return (
        isinstance(model, CausalLM)
        and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
        and ops.available()
    )


def prepare(model: CausalLM, *, release: bool = False) -> NativeBackend:
    """Pack ``model``'s matrices and build its backend. With ``release`` the model's own copies of the packed
    matrices are given back (see `engine.native.packing`): the backend then holds the weights once."""
    if not supports(model):
        raise ValueError(f"the native backend needs a fp32 CausalLM on the CPU and the kernels ({ops.reason()})")
    weights = PackedWeights(model, release)
    prefetch.calibrate_level(weights.packed())  # once per process, on the first model too large for the cache
    prefetch.calibrate(weights.packed())  # the same, under the level chosen
    return NativeBackend(model, weights)


@dataclass(frozen=True)
class Projection:
    """One product of the model (x [M, K] -> [M, N]): on its packed panels, or in torch where it was too
    small to pack."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed: ops.Packed | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return torch_linear(x, self.weight, self.bias)
        if x.stride(-1) != 1:
            x = x.contiguous()
        return ops.linear(x, self.packed, self.bias)


def _projection(weights: PackedWeights, layer: torch.nn.Linear) -> Projection:
    return Projection(layer.weight, layer.bias, weights.get(layer.weight))


@dataclass(frozen=True)
class DenseFFN:
    gate_up: Projection
    down: Projection

    def __call__(self, x: torch.Tensor, count: ExpertCount | None = None) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


@dataclass(frozen=True)
class MoeFFN:
    block: SparseMoeBlock  # the model's: router, routing rule, torch experts where they are not packed
    gate_up: ops.Packed | None
    down: ops.Packed | None
    shared: DenseFFN | None

    def __call__(self, x: torch.Tensor, count: ExpertCount | None) -> torch.Tensor:
        block = self.block
        count = count or ExpertCount(block.top_k)
        if self.gate_up is not None and self.down is not None:
            out = ops.moe(x, block.gate.weight, self.gate_up, self.down, count.k_max, count.per_token,
                          block.normalize_topk)
        else:
            weights, ids = route(block.gate(x), count, block.normalize_topk, x.dtype)
            out = grouped_moe(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids, count.per_token)
        if self.shared is not None and block.shared_expert_gate is not None:
            out = out + torch.sigmoid(block.shared_expert_gate(x)) * self.shared(x)
        return out


def _ffn(weights: PackedWeights, mlp: SparseMoeBlock | DenseMLP) -> DenseFFN | MoeFFN:
    if isinstance(mlp, DenseMLP):
        return DenseFFN(_projection(weights, mlp.gate_up_proj), _projection(weights, mlp.down_proj))
    shared = None if mlp.shared_expert is None else _ffn(weights, mlp.shared_expert)
    assert shared is None or isinstance(shared, DenseFFN)
    return MoeFFN(mlp, weights.get(mlp.experts.gate_up_proj), weights.get(mlp.experts.down_proj), shared)


class NativeLayer:
    """One decoder layer run op by op on the kernels (see the module docstring)."""

    def __init__(self, layer: torch.nn.Module, weights: PackedWeights) -> None:
        if not isinstance(layer, DecoderLayer):
            raise TypeError(f"the native backend runs DecoderLayers, not {type(layer).__name__}")
        self.layer = layer
        self.attn = layer.self_attn
        self.qkv = _projection(weights, self.attn.qkv_proj)
        self.o = _projection(weights, self.attn.o_proj)
        self.ffn = _ffn(weights, layer.mlp)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: PagedPlan,
                  cache: KVCache) -> torch.Tensor:
        """x [T, H] (normed) -> attention output [T, H]; writes this step's K/V into ``cache``."""
        attn, ctx = self.attn, plan.ctx
        k_cache, v_cache = cache
        qkv = self.qkv(x)  # [T, (Hq + 2 Hkv) D]
        native_decode = plan.decode_only and one_call.cache_ok(k_cache, v_cache)
        if native_decode and attn.plain:
            q = ops.rope_write_kv(qkv, attn.n_q, attn.n_kv, attn.head_dim, cos, sin, k_cache, v_cache,
                                  ctx.slot_mapping)
            o = ops.paged_decode(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, attn.scale, attn.window)
        else:
            q, k, v = attn.heads(qkv, cos, sin)  # q/k norms, clipping: the model's own torch maths
            if native_decode:
                write_kv(k_cache, v_cache, k, v, ctx.slot_mapping)
                o = ops.paged_decode(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, attn.scale,
                                     attn.window)
            elif one_call.cache_ok(k_cache, v_cache):  # a prefill or mixed step: each new token a decode query
                write_kv(k_cache, v_cache, k, v, ctx.slot_mapping)
                tables, lens = plan.per_token()
                o = ops.paged_decode(q, k_cache, v_cache, tables, lens, attn.scale, attn.window)
            else:
                o = paged_attention(q, k, v, k_cache, v_cache, plan, attn.scale, attn.window)
        return self.o(o.reshape(x.shape[0], attn.n_q * attn.head_dim))


class NativeBackend:
    """A `CausalLM` on the native kernels (see the module docstring); build it with `prepare`."""

    name = "native"

    def __init__(self, model: CausalLM, weights: PackedWeights) -> None:
        self.model = model
        self.weights = weights
        self.layers = [NativeLayer(layer, weights) for layer in model.model.layers]
        self.lm_head = _projection(weights, model.lm_head)
        self.one_call_gaps = [one_call.one_call_gap(layer.layer, weights) for layer in self.layers]
        # per set of cache tensors (the engine's, and a self-speculation drafter's own)
        self._one_call: dict[tuple[int, ...], ops.DecodeLayers | None] = {}
        self._steps: dict[tuple[int, ...], DecodeStep | None] = {}
        self._last_step: tuple[list[KVCache], int, DecodeStep | None] | None = None  # the cache list it ran on

    @property
    def weight_format(self) -> str:
        """How the products' weights are streamed: ``"fp32 panels"``, ``"bf16 panels"``, or quantized blocks
        such as ``"q4_0 + q8_0 blocks"``."""
        return f"{self.weights.element} {'blocks' if self.weights.quantized else 'panels'}"

    def describe(self) -> str:
        gaps = sorted({gap for gap in self.one_call_gaps if gap is not None})
        decode = ("one native call per decode step" if not gaps else
                  f"native ops per layer (outside the one-call path: {', '.join(gaps)})")
        formats = {p.fmt for p in self.weights.packed()}
        chosen = [c.describe() for fmt in (ops.F32, ops.BF16) if fmt in formats and (c := prefetch.current(fmt))]
        if (level := prefetch.current_level()) is not None:
            chosen.insert(0, level.describe())
        return f"native backend, {self.weight_format}: {decode}" + "".join(f"; {c}" for c in chosen)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                kv_caches: list[KVCache], experts_per_token: torch.Tensor | int | None = None,
                last_token_indices: torch.Tensor | None = None) -> torch.Tensor:
        """The runner's step: flattened input_ids / positions [T] over the paged cache -> logits [T, vocab], or
        [len(last_token_indices), vocab]."""
        step = self.model.step_inputs(input_ids, positions, ctx, kv_caches, experts_per_token)
        plan, count = step.plan, step.count
        assert plan is not None
        # Every layer in one native call where the model allows it, prefill and mixed steps too: each new token is a
        # row with its sequence's block table and its own context (position + 1), the rows' K/V all written before
        # any row attends, so a prefill is causal by construction (per op it was ~10% slower: a parallel region
        # and torch glue per op)
        decode_layers = self._decode_layers(kv_caches)
        if decode_layers is not None:
            norm = self.model.model.norm
            tables, lens = (ctx.block_tables, ctx.context_lens) if plan.decode_only else plan.per_token()
            hidden = ops.decode_layers(
                decode_layers, step.h, step.cos, step.sin, ctx.slot_mapping, tables, lens,
                plan.block_size, count.k_max if count else 0, count.per_token if count else None, norm.weight,
                norm.eps)
        else:
            hidden = self._layers(step.h, step.cos, step.sin, plan, kv_caches, count)
        if last_token_indices is not None:
            hidden = hidden[last_token_indices]
        return self.lm_head(hidden)

    def decode(self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[list[int]],
               experts: Sequence[int | None], kv_caches: list[KVCache], block_size: int
               ) -> tuple[torch.Tensor, list[int]] | None:
        """Logits [B, vocab] of a plain decode step (sequence ``i`` feeds ``tokens[i]`` at ``positions[i]``
        over its blocks ``block_tables[i]``) and each row's argmax, in one native call, or None where this model
        has no such call (`engine.native.step`): the caller then runs the step through `forward`."""
        last = self._last_step
        if last is None or last[0] is not kv_caches or last[1] != block_size:  # not the previous step's cache
            key = (block_size, *(k.data_ptr() for k, _ in kv_caches))
            if key not in self._steps:
                if len(self._steps) >= 4:  # caches come and go with engines: keep the newest few
                    del self._steps[next(iter(self._steps))]
                self._steps[key] = decode_step(self.model, self.weights, kv_caches, block_size)
            last = self._last_step = (kv_caches, block_size, self._steps[key])
        step = last[2]
        return None if step is None else step(tokens, positions, block_tables, experts)

    def _layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: PagedPlan,
                caches: list[KVCache], count: ExpertCount | None) -> torch.Tensor:
        """Every layer op by op, each residual add fused into the RMSNorm that follows it: the residual
        stream ``h`` [T, H] is updated in place and each sub-block's output is added on the next norm."""
        residual = h
        delta: torch.Tensor | None = None
        for layer, cache in zip(self.layers, caches, strict=True):
            first, second = layer.layer.input_layernorm, layer.layer.post_attention_layernorm
            x = ops.add_rmsnorm(residual, delta, first.weight, first.eps)
            attn = layer.attention(x, cos, sin, plan, cache)
            x = ops.add_rmsnorm(residual, attn, second.weight, second.eps)
            delta = layer.ffn(x, count)
        final = self.model.model.norm
        return ops.add_rmsnorm(residual, delta, final.weight, final.eps)

    def _decode_layers(self, caches: list[KVCache]) -> ops.DecodeLayers | None:
        """The one-call spec array over these cache tensors (built once per set of them), or None."""
        key = tuple(k.data_ptr() for k, _ in caches)
        if key not in self._one_call:
            if len(self._one_call) >= 4:  # caches come and go with engines: keep the newest few
                del self._one_call[next(iter(self._one_call))]
            self._one_call[key] = one_call.decode_layers(self.model, self.weights, caches)
        return self._one_call[key]

    def memory_bandwidth(self, gib: float = 1.0, repeats: int = 5) -> float:
        """Best-of-``repeats`` read rate (bytes/s) of a ``gib`` GiB fp32 buffer backed by huge pages as the packed
        weights are, by the faster of torch's reduction and the kernels' streaming sum, at the current thread
        count: the ceiling a weight-bound decode step is measured against."""
        x = ops.empty_huge(int(gib * (1 << 30)) // 4)
        x.fill_(1.0)  # touch every page first
        readers: list[Callable[[], object]] = [x.sum, partial(ops.stream_sum, x)]
        best = float("inf")
        for _ in range(repeats):
            for read in readers:
                start = time.perf_counter()
                read()
                best = min(best, time.perf_counter() - start)
        return x.numel() * 4 / best
