"""GGUF checkpoints: one file holding the config, the tokenizer and the tensors, read with the `gguf` package.

Families (``general.architecture``): ``llama`` (dense Llama, or Mixtral when it has experts), ``qwen2``,
``qwen2moe``, ``qwen3moe``, ``olmoe``. Tensor names are llama.cpp's (``convert_hf_to_gguf.py``):
``token_embd``, ``output_norm``, ``output``; per block ``attn_norm``, ``attn_{q,k,v}`` (+ bias),
``attn_output``, ``attn_{q,k}_norm``, ``ffn_norm``, ``ffn_{gate,up,down}`` (dense), ``ffn_gate_inp``
(router), ``ffn_{gate,up,down}_exps`` (stacked experts), ``ffn_{gate,up,down}_shexp`` and
``ffn_gate_inp_shexp`` (Qwen2-MoE's shared expert). For ``llama`` the converter permutes the q and k rows
for ggml's interleaved RoPE; they are permuted back here (whole rows, so block data too). Llama 3 RoPE
scaling arrives as ``rope_freqs`` (per-frequency divisors of the base frequencies), applied to the loaded
model's rotary frequencies.

Tensor types: F32, F16, BF16 become the model's fp32 parameters; Q8_0 and Q4_0 are kept as their blocks
(`engine.quant.QuantizedWeights`: the native kernels read them as they are, never requantized), with the
dequantized values in the parameters for the plain-torch path; any other type the `gguf` package can
dequantize (Q4_K, Q5_K, Q6_K, ...) is dequantized to fp32 and held as Q8_0 blocks, so it also runs on the
int8 kernels. Norms, routers and embeddings are always fp32 parameters.

The tokenizer is read by `engine.gguf_vocab` (torch-free, for `engine.tokenizer`).

Must not import engine.native, the scheduler, or anything web/db: torch, numpy, gguf and the engine's model
modules.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig, ModelConfigError
from engine.gguf_vocab import GGUFError, fields, reader
from engine.model import CausalLM
from engine.quant import BLOCK, QuantizedMatrix, QuantizedWeights

ARCHITECTURES = ("llama", "qwen2", "qwen2moe", "qwen3moe", "olmoe")

def config_from_metadata(meta: dict[str, Any], tensor_names: set[str] | None = None) -> ModelConfig:
    """The `ModelConfig` of a GGUF file, from its ``{arch}.*`` keys (the HF config that the converter read);
    with ``tensor_names``, a Qwen MoE layer without a router (``ffn_gate_inp``) is a dense MLP layer (HF's
    ``mlp_only_layers``, which GGUF metadata does not carry)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata has no {arch}.{name}")
        return value

    experts = int(key("expert_count", 0) or 0)
    model_type = {"llama": "mixtral" if experts else "llama", "qwen2": "qwen2", "qwen2moe": "qwen2_moe",
                  "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}[arch]
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    raw: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", 0) or 0),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        raw["rope_scaling"] = {"rope_type": scaling, "factor": float(key("rope.scaling.factor", 1.0)),
                               "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length")}
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        raw.update(use_sliding_window=True, sliding_window=int(window))
    if experts:
        raw.update(num_experts=experts, num_local_experts=experts,
                   num_experts_per_tok=int(key("expert_used_count")))
        expert_ff = int(meta.get(f"{arch}.expert_feed_forward_length") or raw["intermediate_size"])
        raw["moe_intermediate_size"] = expert_ff
        if model_type in ("mixtral", "olmoe"):
            raw["intermediate_size"] = expert_ff
        # llama.cpp renormalises the kept top-k for Mixtral and Qwen3-MoE, not for Qwen2-MoE or OLMoE
        norm = meta.get(f"{arch}.expert_weights_norm")
        raw["norm_topk_prob"] = bool(norm) if norm is not None else model_type in ("mixtral", "qwen3_moe")
        shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
        if shared:
            raw["shared_expert_intermediate_size"] = int(shared)
        if tensor_names is not None and model_type in ("qwen2_moe", "qwen3_moe"):
            raw["mlp_only_layers"] = [i for i in range(raw["num_hidden_layers"])
                                      if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    clamp = meta.get(f"{arch}.attention.clamp_kqv")
    if clamp:
        raw["clip_qkv"] = float(clamp)
    if model_type == "qwen2":
        raw["qkv_bias"] = True
    if tensor_names is not None:  # biases are not in the metadata: the tensors say
        raw["attention_bias"] = raw["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
        raw["mlp_bias"] = "blk.0.ffn_down.bias" in tensor_names
    try:
        return ModelConfig.from_hf_dict(raw)
    except (KeyError, ModelConfigError) as exc:
        raise GGUFError(f"GGUF metadata does not make a supported config: {exc}") from exc


def _llama_unpermute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's ``LlamaModel.permute`` along the first (row) dimension."""
    shape = rows.shape
    return rows.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


class _Tensor:
    """One GGUF tensor in the model's orientation: fp32 values, or Q8_0/Q4_0 blocks (uint8 rows)."""

    def __init__(self, raw: Any) -> None:
        from gguf import GGMLQuantizationType as T
        from gguf import quants

        self.name: str = raw.name
        self.shape = tuple(int(d) for d in reversed(raw.shape.tolist()))  # ggml ne is innermost first
        kind = raw.tensor_type
        self.fmt: str | None = None
        self.blocks: torch.Tensor | None = None
        data = np.asarray(raw.data)
        if kind in (T.F32, T.F16):
            self.values = torch.from_numpy(data.astype(np.float32).reshape(self.shape))
        elif kind == T.BF16:
            self.values = torch.from_numpy(data.reshape(-1).view(np.int16).copy()).view(torch.bfloat16).float()
            self.values = self.values.reshape(self.shape)
        elif kind in (T.Q8_0, T.Q4_0):
            self.fmt = "q8_0" if kind == T.Q8_0 else "q4_0"
            self.blocks = torch.from_numpy(data.reshape(*self.shape[:-1], -1).copy())
            self.values = torch.empty(0)
        else:
            try:
                self.values = torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, kind), dtype=np.float32))
            except NotImplementedError as exc:
                raise GGUFError(f"tensor {self.name}: GGUF type {kind.name} is not supported") from exc
            self.values = self.values.reshape(self.shape)
            if self.shape[-1] % BLOCK == 0 and len(self.shape) >= 2:
                self.fmt = "q8_0"  # a k-quant or other type: held as Q8_0 blocks of its values
                from engine.quant import quantize_q8_0

                self.blocks = quantize_q8_0(self.values)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.blocks is not None:
            self.blocks = fn(self.blocks)
        if self.values.numel():
            self.values = fn(self.values)


def _targets(model: CausalLM, name: str) -> tuple[str, torch.Tensor, tuple[Any, ...]] | None:
    """GGUF name -> (our parameter name, the parameter, the index of the slice it fills) or None if unknown."""
    cfg = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name], params[fixed[name]], ()
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    i, base, kind = int(parts[1]), ".".join(parts[2:-1]), parts[-1]
    layer = f"model.layers.{i}"
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv = {"attn_q": slice(0, q_size), "attn_k": slice(q_size, q_size + kv_size),
           "attn_v": slice(q_size + kv_size, q_size + 2 * kv_size)}
    if base in qkv:
        target = f"{layer}.self_attn.qkv_proj.{kind}"
        return (target, params[target], (qkv[base],)) if target in params else None
    simple = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
              "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate", "ffn_down_shexp": "mlp.shared_expert.down_proj",
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_down_exps": "mlp.experts.down_proj"}
    if base in simple:
        target = f"{layer}.{simple[base]}" + ("" if base == "ffn_down_exps" else f".{kind}")
        return (target, params[target], ()) if target in params else None
    halves = {"ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
              "ffn_gate_shexp": ("mlp.shared_expert.gate_up_proj", 0), "ffn_up_shexp": ("mlp.shared_expert.gate_up_proj", 1),
              "ffn_gate_exps": ("mlp.experts.gate_up_proj", 0), "ffn_up_exps": ("mlp.experts.gate_up_proj", 1)}
    if base in halves:
        module, half = halves[base]
        target = f"{layer}.{module}" + ("" if base.endswith("_exps") else f".{kind}")
        if target not in params:
            return None
        p = params[target]
        rows = p.shape[-2] if p.dim() >= 2 else p.shape[0]
        size = rows // 2
        index: tuple[Any, ...] = (slice(None), slice(half * size, (half + 1) * size)) if base.endswith("_exps") \
            else (slice(half * size, (half + 1) * size),)
        return target, p, index
    return None


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> tuple[CausalLM, ModelConfig]:
    """Build the model a GGUF file describes and load its tensors (see the module docstring); Q8_0 / Q4_0 (and
    other quantized) tensors are set as ``model.quantized``. Every parameter must be covered (a tied LM head
    excepted: a file without ``output.weight`` ties it to the embedding)."""
    gguf_file = reader(path)
    meta = fields(gguf_file)
    names = {t.name for t in gguf_file.tensors}
    config = config_from_metadata(meta, names)
    if "output.weight" not in names and not config.tie_word_embeddings:
        from dataclasses import replace

        config = replace(config, tie_word_embeddings=True)
    if dtype != torch.float32 and any(t.tensor_type.name in ("Q8_0", "Q4_0") for t in gguf_file.tensors):
        raise GGUFError("a GGUF with Q8_0 / Q4_0 tensors loads as a fp32 model (its matrices run on int8 kernels)")
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rotary()
    # blocks of the quantized matrices, per parameter, filled slice by slice (q/k/v, gate/up): target ->
    # (parameter, format, blocks, elements filled from blocks); a parameter whose slices came in different
    # formats, or partly unquantized, is requantized as a whole to Q8_0 at the end
    pending: dict[str, tuple[torch.Tensor, str, torch.Tensor, int]] = {}
    mixed: set[str] = set()
    filled: dict[str, int] = {}
    arch = meta["general.architecture"]
    with torch.no_grad():
        for raw in gguf_file.tensors:
            tensor = _Tensor(raw)
            found = _targets(model, tensor.name)
            if found is None:
                if tensor.name == "rope_freqs.weight":  # Llama 3 RoPE scaling, as per-frequency divisors
                    rotary = model.model.rotary_emb
                    if tuple(tensor.values.shape) != tuple(rotary.inv_freq.shape):
                        raise GGUFError(f"rope_freqs has shape {tuple(tensor.values.shape)}, expected "
                                        f"{tuple(rotary.inv_freq.shape)}")
                    rotary.inv_freq = rotary.inv_freq / tensor.values.to(rotary.inv_freq)
                    continue
                raise GGUFError(f"unexpected GGUF tensor {tensor.name!r} for a {config.model_type} model")
            target, param, index = found
            base = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
            if arch == "llama" and base in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if base == "attn_q" else config.num_key_value_heads
                tensor.map_rows(partial(_llama_unpermute, n_head=heads))
            if tensor.blocks is not None and not tensor.values.numel():
                tensor.values = QuantizedMatrix(tensor.fmt or "q8_0", tensor.blocks, tensor.shape).dequantize()
            view = param[index] if index else param
            values = tensor.values
            if tuple(values.shape) != tuple(view.shape):
                raise GGUFError(f"{tensor.name} has shape {tuple(values.shape)}, {target} expects {tuple(view.shape)}")
            view.copy_(values.to(view.dtype))
            filled[target] = filled.get(target, 0) + values.numel()
            if param.dim() < 2 or param.shape[-1] % BLOCK:
                continue
            if tensor.blocks is None or tensor.fmt is None:
                if target in pending:
                    mixed.add(target)
                continue
            if target not in pending:
                row_bytes = tensor.blocks.shape[-1]
                pending[target] = (param, tensor.fmt, torch.zeros(*param.shape[:-1], row_bytes, dtype=torch.uint8), 0)
            p, fmt, blocks, done = pending[target]
            if fmt != tensor.fmt:
                mixed.add(target)
                continue
            blocks[index if index else ...] = tensor.blocks
            pending[target] = (p, fmt, blocks, done + values.numel())
    expected = {name: p.numel() for name, p in model.named_parameters()}
    missing = [n for n, size in expected.items() if filled.get(n, 0) != size]
    if config.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise GGUFError(f"the GGUF file does not cover {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    if pending:
        formats = {fmt for _, fmt, _, _ in pending.values()}
        quantized = QuantizedWeights("q4_0" if "q4_0" in formats else "q8_0")
        for target, (param, fmt, blocks, done) in pending.items():
            if target in mixed or done != param.numel():
                quantized.add(param, QuantizedMatrix.of(param, "q8_0"))
            else:
                quantized.add(param, QuantizedMatrix(fmt, blocks, tuple(param.shape)))
        model.quantized = quantized
    model.eval()
    return model, config
