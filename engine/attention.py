"""Attention kernels in plain torch: the paged-KV path (prefill, decode, mixed) and the no-cache causal path.

The serving runner describes a flattened batch with `AttentionContext`; the model calls `plan_paged` once per
forward (the only host sync) and then `paged_attention` once per layer. The KV cache of a layer is a pair of
tensors `[num_blocks, block_size, num_kv_heads, head_dim]`; `slot_mapping` gives, for each new token, the flat
slot `block_id * block_size + offset` its K/V is written to, and `block_tables` lists each sequence's blocks.

Decode-only batches (one new token per sequence) run as one batched `scaled_dot_product_attention`: the K/V
blocks are gathered per sequence and the query heads that share a KV head are laid out as that head's queries,
so GQA needs no K/V expansion. Batches with a prefill loop over sequences (prefill is compute-bound).

Pure torch: must not import the model, the scheduler, engine.native, or anything outside torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionContext:
    is_prefill: bool  # True if any sequence in the batch has >1 new token (mixed batches allowed)
    query_start_loc: (
        torch.Tensor
    )  # int64 [B+1], cumulative new-token counts per sequence in the flattened batch
    context_lens: torch.Tensor  # int64 [B], total tokens (cached + new) per sequence after this step
    slot_mapping: (
        torch.Tensor
    )  # int64 [T], flat cache slot (block_id*block_size + offset) for each new token's K/V
    block_tables: torch.Tensor  # int64 [B, max_blocks], -1 padded


@dataclass
class PagedPlan:
    """Host-side facts about a batch, computed once per forward and shared by every layer."""

    ctx: AttentionContext
    block_size: int
    query_lens: list[int]
    context_lens: list[int]
    decode_only: bool
    # decode-only batches: block ids to gather [B, nb] and the key positions [nb * block_size]
    gather_blocks: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _per_token: tuple[torch.Tensor, torch.Tensor] | None = None

    def per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every new token as a one-query sequence of its own: its sequence's block table (``ctx.block_tables``'
        row, [T, width]) and the keys it sees (its position + 1, [T]), int64, built once per forward for every
        layer; how a prefill runs on a decode attention kernel (causal by construction; a sliding window applies
        per query as in decode)."""
        if self._per_token is None:
            rows: list[int] = []
            lens: list[int] = []
            for row, (n_new, n_ctx) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
                rows += [row] * n_new
                lens += range(n_ctx - n_new + 1, n_ctx + 1)
            self._per_token = (self.ctx.block_tables.index_select(0, torch.tensor(rows, dtype=torch.int64)),
                               torch.tensor(lens, dtype=torch.int64))
        return self._per_token

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, 1, L] bool: key j is visible to the (single) query of sequence b."""
        if window not in self._masks:
            assert self.key_positions is not None
            lens = self.ctx.context_lens.to(self.key_positions.device)[:, None]
            mask = self.key_positions[None, :] < lens
            if window is not None:
                mask &= self.key_positions[None, :] >= lens - window
            self._masks[window] = mask[:, None, None, :]
        return self._masks[window]


def plan_paged(ctx: AttentionContext, block_size: int) -> PagedPlan:
    starts = ctx.query_start_loc.tolist()
    query_lens = [b - a for a, b in itertools.pairwise(starts)]
    context_lens = ctx.context_lens.tolist()
    if len(query_lens) != len(context_lens):
        raise ValueError("query_start_loc and context_lens disagree on the batch size")
    decode_only = all(n == 1 for n in query_lens)
    plan = PagedPlan(ctx, block_size, query_lens, context_lens, decode_only)
    if decode_only and query_lens:
        n_blocks = -(-max(context_lens) // block_size)
        plan.gather_blocks = ctx.block_tables[:, :n_blocks].clamp(min=0)
        plan.key_positions = torch.arange(n_blocks * block_size, device=ctx.block_tables.device)
    return plan


# -- int8 KV cache: each [D] row of a head is D int8 values and its fp32 scale (4 bytes) ------------------
SCALE_BYTES = 4


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension for ``head_dim``: room for the scale in an int8 cache."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8: symmetric per-row int8 (absmax / 127) with the fp32 scale packed
    into the last four bytes."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / 127.0).clamp_min(1e-12)
    q = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv(x: torch.Tensor) -> torch.Tensor:
    """The inverse of `quantize_kv` (float32); float caches pass through unchanged."""
    if x.dtype != torch.int8:
        return x
    scale = x[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return x[..., :-SCALE_BYTES].float() * scale


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V [T, Hkv, D] into the paged cache at `slot_mapping` [T] (quantized for an int8 cache)."""
    if k_cache.dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
    num_blocks, block_size, n_kv, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, n_kv, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, n_kv, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PagedPlan,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], new k/v [T, Hkv, D] -> attention output [T, Hq, D]; writes k/v into the cache first."""
    write_kv(k_cache, v_cache, k, v, plan.ctx.slot_mapping)
    if plan.decode_only:
        return _decode(q, k_cache, v_cache, plan, scale, window)
    out = torch.empty_like(q)
    start = 0
    for row, (n_new, n_ctx) in enumerate(zip(plan.query_lens, plan.context_lens, strict=True)):
        end = start + n_new
        if n_new == 0:
            continue
        if n_new == n_ctx:  # nothing cached before this step: attend to the fresh K/V directly
            keys, values = k[start:end], v[start:end]
        else:
            keys, values = _gather_sequence(
                k_cache, v_cache, plan.ctx.block_tables[row], n_ctx, plan.block_size
            )
        out[start:end] = _attend_one(q[start:end], keys, values, n_ctx, scale, window)
        start = end
    return out


def _gather_sequence(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_row: torch.Tensor, n_ctx: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = block_row[: -(-n_ctx // block_size)]
    n_kv, width = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache.index_select(0, blocks).reshape(-1, n_kv, width)[:n_ctx]
    values = v_cache.index_select(0, blocks).reshape(-1, n_kv, width)[:n_ctx]
    return dequantize_kv(keys), dequantize_kv(values)


def _attend_one(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n_ctx: int, scale: float, window: int | None
) -> torch.Tensor:
    """One sequence: q [n, Hq, D] are the last n positions of a context of n_ctx keys [n_ctx, Hkv, D]."""
    n_new = q.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1).to(q.dtype), values.transpose(0, 1).to(q.dtype)
    gqa = qh.shape[0] != kh.shape[0]
    if n_new == n_ctx and window is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(n_ctx - n_new, n_ctx, device=q.device)[:, None]
        k_pos = torch.arange(n_ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(0, 1)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PagedPlan,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    assert plan.gather_blocks is not None
    batch, n_q, head_dim = q.shape
    n_kv, width = k_cache.shape[2], k_cache.shape[3]
    group = n_q // n_kv
    flat_blocks = plan.gather_blocks.reshape(-1)  # index_select: no parallel region for small gathers
    keys = dequantize_kv(
        k_cache.index_select(0, flat_blocks).view(batch, -1, n_kv, width)
    ).transpose(1, 2)  # [B, Hkv, L, D]
    values = dequantize_kv(v_cache.index_select(0, flat_blocks).view(batch, -1, n_kv, width)).transpose(1, 2)
    qg = q.view(batch, n_kv, group, head_dim)  # the G query heads of a KV head act as G queries
    o = F.scaled_dot_product_attention(
        qg, keys.to(q.dtype), values.to(q.dtype), attn_mask=plan.decode_mask(window), scale=scale
    )
    return o.reshape(batch, n_q, head_dim)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """No cache: q [..., T, Hq, D], k/v [..., T, Hkv, D] -> [..., T, Hq, D]. Differentiable (training path)."""
    qh, kh, vh = q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)
    gqa = qh.shape[-3] != kh.shape[-3]
    if window is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        n = q.shape[-3]
        pos = torch.arange(n, device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(-3, -2)
