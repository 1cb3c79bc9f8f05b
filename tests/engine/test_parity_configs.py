"""Real checkpoint configs (as published on the Hub, pre-transformers-5 spelling) build the same architecture
as transformers does: same parameter count, built on the meta device so nothing is allocated."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.config import ModelConfig
from engine.model import CausalLM

HUB_CONFIGS: dict[str, dict[str, Any]] = {
    "Mixtral-8x7B-v0.1": {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "Qwen1.5-MoE-A2.7B": {
        "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "vocab_size": 151936, "rope_theta": 1e6, "use_sliding_window": False,
        "sliding_window": 32768, "max_window_layers": 21, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    },
    "Qwen3-30B-A3B": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 151936, "rope_theta": 1e6, "rope_scaling": None,
        "attention_bias": False, "use_sliding_window": False, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    },
    "OLMoE-1B-7B-0924": {
        "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "norm_topk_prob": False, "clip_qkv": None, "vocab_size": 50304, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    },
    "Llama-3.2-1B": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    },
    "Qwen2.5-0.5B": {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1e6,
        "max_position_embeddings": 32768, "tie_word_embeddings": True, "use_sliding_window": False,
        "sliding_window": 32768, "max_window_layers": 24, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    },
}  # fmt: skip

# Published totals, to catch a config typed wrong here (the exact check is against transformers below).
PUBLISHED_BILLIONS = {
    "Mixtral-8x7B-v0.1": 46.7,
    "Qwen1.5-MoE-A2.7B": 14.3,
    "Qwen3-30B-A3B": 30.5,
    "OLMoE-1B-7B-0924": 6.9,
    "Llama-3.2-1B": 1.24,
    "Qwen2.5-0.5B": 0.49,
}


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_hub_config_builds_the_transformers_architecture(name: str) -> None:
    import transformers as tf

    raw = HUB_CONFIGS[name]
    config = ModelConfig.from_hf_dict(raw)
    with torch.device("meta"):
        ours = CausalLM(config)
        hf_config = tf.AutoConfig.for_model(**raw)
        theirs = tf.AutoModelForCausalLM.from_config(hf_config)
    ours_total = ours.parameter_counts()[0]
    theirs_total = sum(p.numel() for p in theirs.parameters())
    assert ours_total == theirs_total
    assert ours_total / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], rel=0.02)


def test_hub_config_field_normalisation() -> None:
    mixtral = ModelConfig.from_hf_dict(HUB_CONFIGS["Mixtral-8x7B-v0.1"])
    assert (mixtral.num_experts, mixtral.head_dim, mixtral.rope.theta, mixtral.sliding_window) == (
        8,
        128,
        1e6,
        None,
    )
    assert mixtral.eos_token_ids == (2,) and mixtral.norm_topk_prob
    llama = ModelConfig.from_hf_dict(HUB_CONFIGS["Llama-3.2-1B"])
    assert llama.rope.rope_type == "llama3" and llama.rope.original_max_position_embeddings == 8192
    assert llama.tie_word_embeddings and not llama.is_moe
    qwen3 = ModelConfig.from_hf_dict(HUB_CONFIGS["Qwen3-30B-A3B"])
    assert qwen3.qk_norm == "head" and qwen3.head_dim == 128 and qwen3.rope.rope_type == "default"
    olmoe = ModelConfig.from_hf_dict(HUB_CONFIGS["OLMoE-1B-7B-0924"])
    assert olmoe.qk_norm == "full" and olmoe.clip_qkv is None and not olmoe.norm_topk_prob
    qwen2 = ModelConfig.from_hf_dict(HUB_CONFIGS["Qwen2.5-0.5B"])
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None
