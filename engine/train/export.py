"""Build a trainable `engine.model.CausalLM` and save it as a Hugging Face checkpoint directory.

`engine.model` fuses weights for speed (`qkv_proj`, `gate_up_proj`, experts stacked as
[E, ...]); `engine.weights.hf_state_dict` maps them back to the names the Hugging Face Hub
uses for each family (Mixtral `block_sparse_moe.experts.N.w1/w3/w2`, Llama
`mlp.gate_proj/up_proj`, separate `q/k/v_proj`), so transformers and `engine.model.load_model`
both read what we write. Saving is atomic (write, then rename), so a run stopped
mid-checkpoint still leaves the previous checkpoint.

Must not import the gateway, the classifier or any web/db library.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from engine.config import ModelConfig
from engine.model import CausalLM
from engine.weights import hf_state_dict

INIT_STD = 0.02


def build_model(hf_config: dict[str, Any], seed: int | None = None) -> CausalLM:
    """A freshly initialised fp32 model for a HF config dict (GPT-2 style init, residual outputs scaled)."""
    if seed is not None:
        torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_hf_dict(hf_config))
    n_layers = model.config.num_hidden_layers
    residual_std = INIT_STD / math.sqrt(2 * n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.normal_(0.0, residual_std)
            else:
                p.normal_(0.0, INIT_STD)
    model.reset_rotary()
    return model


def active_parameters(hf_config: dict[str, Any], k: int) -> int:
    """Parameters touched per token with k experts (all of them for a dense model, k ignored)."""
    cfg = ModelConfig.from_hf_dict(hf_config)
    with torch.device("meta"):
        model = CausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    if not cfg.is_moe:
        return total
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    sparse_layers = sum(cfg.layer_is_sparse(i) for i in range(cfg.num_hidden_layers))
    return total - sparse_layers * (cfg.num_experts - k) * per_expert


def save_checkpoint(model: nn.Module, hf_config: dict[str, Any], out_dir: str | Path,
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `config.json` and `model.safetensors` (in `dtype`) into `out_dir`; returns the weights path."""
    if not isinstance(model, CausalLM):
        raise TypeError("save_checkpoint expects an engine.model.CausalLM")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in hf_state_dict(model).items()}
    weights = out / "model.safetensors"
    tmp = out / ".model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, weights)
    config = {**hf_config, "torch_dtype": str(dtype).removeprefix("torch.")}
    cfg_tmp = out / ".config.json.tmp"
    cfg_tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    os.replace(cfg_tmp, out / "config.json")
    return weights
