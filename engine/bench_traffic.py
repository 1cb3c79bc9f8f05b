"""The weight traffic of a decode step, for `tiergate bench engine`'s ceilings (engine.bench): the bytes
of weights one step reads at batch 1 and for several streams (the experts any of their tokens picked
read once), the share of them that are experts, and part (c)'s second ceiling (the products over the
weights every token reads, at a measured multiply-add rate). Pure arithmetic over a model config.
Imports torch only.
"""

from __future__ import annotations

from typing import Any

import torch


def decode_weight_bytes(config: Any, k: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of weights one batch-1 decode step reads: attention, router, k experts per MoE layer
    (dense MLP on dense layers), norms, one embedding row and the LM head."""
    h, hd = config.hidden_size, config.head_dim
    attn = h * hd * (config.num_attention_heads + 2 * config.num_key_value_heads) + config.num_attention_heads * hd * h
    per_layer_sparse = h * config.num_experts + k * 3 * h * config.moe_intermediate_size + 3 * h * (
        config.shared_expert_intermediate_size) + (h if config.shared_expert_intermediate_size else 0)
    per_layer_dense = 3 * h * config.intermediate_size
    total = 0
    for i in range(config.num_hidden_layers):
        mlp = per_layer_sparse if config.is_moe and config.layer_is_sparse(i) else per_layer_dense
        total += attn + mlp + 2 * h
    total += h + h + config.vocab_size * h
    return total * (torch.finfo(dtype).bits // 8)


def expert_coverage(num_experts: int, k: int, tokens: int) -> float:
    """Expected fraction of experts that ``tokens`` tokens, each picking ``k`` distinct experts uniformly,
    select between them (random routers are close to uniform)."""
    return 1.0 - ((num_experts - k) / num_experts) ** tokens


def expert_bytes(config: Any, dtype: torch.dtype) -> int:
    """One expert's weight bytes over all layers."""
    return decode_weight_bytes(config, 2, dtype) - decode_weight_bytes(config, 1, dtype)


def shared_weight_bytes(config: Any, k: int, dtype: torch.dtype = torch.float32) -> int:
    """The weight bytes of a decode step that every token reads whichever experts it picks: attention, router,
    norms, its embedding row and the LM head (a dense model: all of them)."""
    one = decode_weight_bytes(config, k, dtype)
    return one - k * expert_bytes(config, dtype) if config.is_moe else one


def step_weight_bytes(config: Any, k: int, streams: int, dtype: torch.dtype = torch.float32) -> float:
    """Expected weight bytes one decode step of ``streams`` sequences reads: the dense part once, and each
    expert that any of the tokens picked once."""
    shared = shared_weight_bytes(config, k, dtype)
    if not config.is_moe:
        return shared
    return shared + config.num_experts * expert_coverage(config.num_experts, k, streams) * expert_bytes(config, dtype)


def products_ceiling(most: int, shared: float, many_bytes: float, macs: float, streamed: float, one: float) -> float:
    """Part (c)'s second ceiling: a ``most``-stream step with its products over the ``shared`` weight bytes every
    token reads at ``macs`` multiply-adds/s (fp32: one a weight and token) or their bytes at ``streamed``
    bytes/s, whichever is slower, and the rest of its ``many_bytes`` at ``streamed``; as a ratio to one stream's
    ``one`` tokens/s."""
    step = max(most * shared / 4 / macs, shared / streamed) + (many_bytes - shared) / streamed
    return most / (step * one)


def expert_share(config: Any, k: int, dtype: torch.dtype = torch.float32) -> float:
    """The share of a batch-1 decode step's weight bytes that are its ``k`` experts."""
    return k * expert_bytes(config, dtype) / decode_weight_bytes(config, k, dtype)
