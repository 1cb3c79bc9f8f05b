"""Model configuration: one frozen dataclass normalising the HF `config.json` of every supported family.

Supported `model_type`s: mixtral, qwen2_moe, qwen3_moe, olmoe (sparse MoE) and llama, qwen2 (dense, used as
draft models). Each family spells the same idea differently (`num_local_experts` vs `num_experts`,
`qkv_bias` vs `attention_bias`, `rope_scaling` vs `rope_parameters`); this module is the only place that knows
those spellings. The model code reads `ModelConfig` only.

Must not import torch, the model, or anything outside the standard library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "llama", "qwen2")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class ModelConfigError(ValueError):
    """A config.json this engine cannot run (unknown family, unsupported option)."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters` / legacy `rope_theta` + `rope_scaling`)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs, in one vocabulary for all families."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (dense families and non-sparse layers)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (Qwen3: per head) | "full" (OLMoE: over the whole projection)
    clip_qkv: float | None = None
    # Mixture of experts (num_experts == 0 means a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert, gated by sigmoid(shared_expert_gate)
    norm_topk_prob: bool = True  # renormalise the kept top-k probabilities to sum to one
    sparse_layers: tuple[bool, ...] = ()  # per layer: MoE block (True) or dense MLP (False)
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()  # per layer: sliding-window attention applies
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_sparse(self, layer_idx: int) -> bool:
        return self.is_moe and self.sparse_layers[layer_idx]

    def layer_window(self, layer_idx: int) -> int | None:
        if self.sliding_window and self.sliding_layers and self.sliding_layers[layer_idx]:
            return self.sliding_window
        return None

    def validate_experts_per_token(self, k: int) -> int:
        """Return `k` if it is a valid per-token expert count for this model, else raise ValueError."""
        if not self.is_moe:
            raise ValueError(f"{self.model_type} is a dense model; experts_per_token does not apply")
        if not 1 <= int(k) <= self.num_experts:
            raise ValueError(f"experts_per_token must be between 1 and {self.num_experts}, got {k}")
        return int(k)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        with path.open(encoding="utf-8") as f:
            raw = json.load(f)
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.exists():
            with gen_path.open(encoding="utf-8") as f:
                gen = json.load(f)
            if gen.get("eos_token_id") is not None:
                raw = {**raw, "_generation_eos_token_id": gen["eos_token_id"]}
        return cls.from_hf_dict(raw)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Normalise a HF `config.json` dict."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        hidden = int(raw["hidden_size"])
        n_heads = int(raw["num_attention_heads"])
        n_kv = int(raw.get("num_key_value_heads") or n_heads)
        head_dim = int(raw.get("head_dim") or hidden // n_heads)
        n_layers = int(raw["num_hidden_layers"])
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported (only silu)")
        common: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw.get("intermediate_size") or 0),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope=_rope_from_hf(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            hidden_act=act,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw),
        )
        common.update(_family_fields(model_type, raw, n_layers))
        return cls(**common)


def _family_fields(model_type: str, raw: dict[str, Any], n_layers: int) -> dict[str, Any]:
    attention_bias = bool(raw.get("attention_bias", False))
    if model_type in ("llama", "qwen2"):
        qkv_bias = True if model_type == "qwen2" else attention_bias
        return dict(
            qkv_bias=qkv_bias,
            o_bias=attention_bias if model_type == "llama" else False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            **(_sliding(raw, n_layers, model_type) if model_type == "qwen2" else {}),
        )
    if model_type == "mixtral":
        window = raw.get("sliding_window")
        return dict(
            num_experts=_num_experts(raw),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,  # Mixtral: softmax over the top-k logits
            sparse_layers=(True,) * n_layers,
            sliding_window=int(window) if window else None,
            sliding_layers=(True,) * n_layers if window else (),
        )
    # qwen2_moe, qwen3_moe, olmoe
    num_experts = _num_experts(raw)
    if model_type == "olmoe":
        sparse = (True,) * n_layers
    else:
        mlp_only = set(raw.get("mlp_only_layers") or [])
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        sparse = tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(n_layers))
    fields: dict[str, Any] = dict(
        num_experts=num_experts,
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(
            raw["moe_intermediate_size"] if model_type != "olmoe" else raw["intermediate_size"]
        ),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )
    if model_type == "qwen2_moe":
        fields.update(
            qkv_bias=bool(raw.get("qkv_bias", True)),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            **_sliding(raw, n_layers, model_type),
        )
    elif model_type == "qwen3_moe":
        fields.update(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            qk_norm="head",
            **_sliding(raw, n_layers, model_type),
        )
    else:  # olmoe
        clip = raw.get("clip_qkv")
        fields.update(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            qk_norm="full",
            clip_qkv=float(clip) if clip is not None else None,
        )
    return fields


def _num_experts(raw: dict[str, Any]) -> int:
    value = raw.get("num_experts", raw.get("num_local_experts"))
    if value is None:
        raise ModelConfigError("MoE config without num_experts / num_local_experts")
    return int(value)


def _sliding(raw: dict[str, Any], n_layers: int, model_type: str) -> dict[str, Any]:
    """Which layers use sliding-window attention, per the family's HF config rules.

    Qwen-style configs slide only when `use_sliding_window`; `layer_types` (written by transformers 5) names
    the layers, otherwise each family's legacy default applies.
    """
    if not raw.get("use_sliding_window", False):
        return {}
    window = raw.get("sliding_window")
    if not window:
        return {}
    layer_types = raw.get("layer_types")
    max_window_layers = int(raw.get("max_window_layers", n_layers))
    if layer_types:
        layers = tuple(t == "sliding_attention" for t in layer_types)
    elif model_type == "qwen2":
        layers = tuple(i >= max_window_layers for i in range(n_layers))
    elif model_type == "qwen2_moe":
        layers = tuple(bool((i + 1) % 2) and i < max_window_layers for i in range(n_layers))
    else:  # qwen3_moe: every layer
        layers = (True,) * n_layers
    return dict(sliding_window=int(window), sliding_layers=layers)


def _rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError("per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"rope_type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    orig = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if orig is None and rope_type in ("llama3", "yarn"):
        orig = raw.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = raw.get("max_position_embeddings", 1) / orig if rope_type == "yarn" and orig else 1.0
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ModelConfigError("partial_rotary_factor != 1 is not supported")
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for key in ("eos_token_id", "_generation_eos_token_id"):
        value = raw.get(key)
        if value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            if int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)
