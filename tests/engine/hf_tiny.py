"""Test helper: random tiny HF models for every supported family, saved in HF format, and a paged-KV driver.

Uses `transformers` (a test-only dependency) with no network: configs are built in code, weights are drawn
with a fixed seed and scaled up from HF's tiny default init so logits are far from uniform (greedy decoding
then has clear winners). `PagedSequences` hands out shuffled cache blocks and builds `AttentionContext`s the
way the serving runner does, so model tests do not depend on the scheduler.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.attention import AttentionContext

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama", "qwen2")

_BASE: dict[str, Any] = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def tiny_config(family: str, **overrides: Any) -> Any:
    import transformers as tf

    kw = dict(_BASE)
    if family == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
        cls = tf.MixtralConfig
    elif family == "qwen2_moe":
        kw.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            num_hidden_layers=3,
            mlp_only_layers=[1],
        )
        cls = tf.Qwen2MoeConfig
    elif family == "qwen3_moe":
        kw.update(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=24
        )
        cls = tf.Qwen3MoeConfig
    elif family == "olmoe":
        kw.update(
            num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False, clip_qkv=3.0
        )
        cls = tf.OlmoeConfig
    elif family == "llama":
        kw.update(
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = tf.LlamaConfig
    elif family == "qwen2":
        kw.update(tie_word_embeddings=True)
        cls = tf.Qwen2Config
    else:
        raise ValueError(family)
    kw.update(overrides)
    return cls(**kw)


def build_hf_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A random tiny HF causal LM (fp32, eager attention, eval mode) with well-spread weights."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def save_hf_model(model: Any, path: Path) -> Path:
    model.save_pretrained(path)
    return path


@dataclass
class PagedSequences:
    """Hands out shuffled cache blocks to sequences and builds the AttentionContext for a step."""

    num_blocks: int
    block_size: int
    seed: int = 0
    _free: list[int] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self._free)

    def step(self, new_tokens: dict[int, int]) -> tuple[AttentionContext, torch.Tensor]:
        """Append `n` new tokens to each sequence id; returns (ctx, positions [T]) for the flattened batch."""
        starts, ctx_lens, slots, positions = [0], [], [], []
        for seq, n in new_tokens.items():
            table = self.tables.setdefault(seq, [])
            old = self.lengths.get(seq, 0)
            total = old + n
            while len(table) * self.block_size < total:
                table.append(self._free.pop())
            for p in range(old, total):
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
                positions.append(p)
            self.lengths[seq] = total
            starts.append(starts[-1] + n)
            ctx_lens.append(total)
        width = max(len(self.tables[s]) for s in new_tokens)
        tables = [self.tables[s] + [-1] * (width - len(self.tables[s])) for s in new_tokens]
        ctx = AttentionContext(
            is_prefill=any(n > 1 for n in new_tokens.values()),
            query_start_loc=torch.tensor(starts, dtype=torch.int64),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int64),
        )
        return ctx, torch.tensor(positions, dtype=torch.int64)
