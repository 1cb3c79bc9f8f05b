"""Test helper: write a HF safetensors checkpoint as GGUF with the `gguf` package's GGUFWriter, the way
llama.cpp's ``convert_hf_to_gguf.py`` does for the engine's families (written here independently of
`engine.gguf`, so the loader is tested against the converter's conventions rather than its own inverse):

- metadata ``{arch}.*`` from config.json; the tokenizer from tokenizer.json (byte-level BPE ``gpt2`` model,
  ``qwen2`` pre-tokenizer, vocabulary, merges, token types: the special tokens CONTROL);
- tensor names per gguf's TENSOR_NAMES, per-expert tensors stacked into ``ffn_{gate,up,down}_exps``
  ``[E, I, H]``, the router and shared-expert gate ``ffn_gate_inp(_shexp)``;
- Llama/Mixtral (arch ``llama``): q and k rows permuted for ggml's interleaved RoPE (``LlamaModel.permute``),
  Llama 3 RoPE scaling written as the ``rope_freqs`` tensor;
- 1-D tensors and the routers stay F32 (as the converter keeps them); every other matrix is written in
  ``qtype`` (``F32``, ``F16``, ``BF16``, ``Q8_0``, ``Q4_0``), except ``token_embd`` (F32 here, unless the LM
  head is tied to it) and ``output`` (``output_qtype``: ``Q8_0`` with Q4_0 files, as llama-quantize keeps the output matrix higher),
  and rows that do not split into the type's blocks stay F32 (the converter's fallback).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

ARCH = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
        "olmoe": "olmoe"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _permute(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(cfg: dict[str, Any], rope: dict[str, Any]) -> torch.Tensor:
    import math

    base = rope.get("rope_theta", 10000.0)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
    assert m is not None and m.group(2) in _LAYER, f"no GGUF name for {hf}"
    return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def hf_to_gguf(model_dir: Path, out: Path, qtype: str = "F32", output_qtype: str | None = None,
               raw: dict[str, tuple[np.ndarray, str]] | None = None) -> Path:
    """Write ``model_dir`` as GGUF at ``out``; ``raw`` replaces named tensors by given block bytes of a type."""
    import gguf

    cfg: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    family = cfg["model_type"]
    arch = ARCH[family]
    tensors = load_file(str(model_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out), arch)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    n_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if family in ("mixtral", "olmoe"):
        writer.add_feed_forward_length(cfg["intermediate_size"])
    else:
        writer.add_feed_forward_length(cfg.get("intermediate_size") or 0)
    if n_experts:
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg.get("clip_qkv"):
        writer.add_clamp_kqv(cfg["clip_qkv"])
    _add_tokenizer(writer, model_dir)

    qt = getattr(gguf.GGMLQuantizationType, qtype)
    out_qt = getattr(gguf.GGMLQuantizationType, output_qtype or qtype)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    named: list[tuple[str, torch.Tensor]] = []
    for name, t in tensors.items():
        if m := _EXPERT.match(name):
            experts.setdefault((int(m.group(1)), _EXPERT_PART[m.group(3)]), {})[int(m.group(2))] = t
            continue
        if arch == "llama" and ".self_attn.q_proj." in name:
            t = _permute(t, heads, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            t = _permute(t, heads, kv_heads)
        named.append((_gguf_name(name), t))
    if rope.get("rope_type") == "llama3":  # convert_hf_to_gguf's LlamaModel.generate_extra_tensors
        named.append(("rope_freqs.weight", _llama3_factors(cfg, rope)))
    for (layer, part), by_expert in sorted(experts.items()):
        named.append((f"blk.{layer}.ffn_{part}_exps.weight", torch.stack([by_expert[e] for e in sorted(by_expert)])))
    tied = "output.weight" not in {n for n, _ in named}
    for name, t in named:
        if raw and name in raw:
            blocks, kind_name = raw[name]
            writer.add_tensor(name, blocks, raw_dtype=getattr(gguf.GGMLQuantizationType, kind_name))
            continue
        data = t.float().numpy()
        if data.ndim == 1 or "ffn_gate_inp" in name or (name == "token_embd.weight" and not tied):
            writer.add_tensor(name, data.astype(np.float32))
            continue
        kind = out_qt if name in ("output.weight", "token_embd.weight") else qt
        if kind == gguf.GGMLQuantizationType.F32 or data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
            # the converter's fallback for rows that do not split into the type's blocks
            writer.add_tensor(name, data)
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer: Any, model_dir: Path) -> None:
    import gguf

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    specials = {t["id"] for t in tok["added_tokens"] if t.get("special")}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    writer.add_token_merges(merges)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    eos = cfg.get("eos_token")
    if isinstance(eos, str) and eos in vocab:
        writer.add_eos_token_id(vocab[eos])
    if cfg.get("chat_template"):
        writer.add_chat_template(cfg["chat_template"])
