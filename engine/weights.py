"""Safetensors checkpoints with HF tensor names: read (single file or sharded index) and map onto `CausalLM`.

HF names map one-to-one onto ours except fused/stacked tensors:
- `self_attn.{q,k,v}_proj.{weight,bias}` -> row slices of `self_attn.qkv_proj`;
- `mlp.{gate,up}_proj` and `mlp.shared_expert.{gate,up}_proj` -> row halves of `*.gate_up_proj`;
- per-expert tensors `experts.N.{gate_proj|w1, up_proj|w3, down_proj|w2}.weight` (what `save_pretrained`
  writes) or transformers-5 fused `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]
  -> `mlp.experts.gate_up_proj[N]` / `mlp.experts.down_proj[N]`;
- Mixtral's `block_sparse_moe` is our `mlp`.
Every parameter must be covered exactly (tied `lm_head` excepted); unknown names raise `WeightLoadError`.
`hf_state_dict` is the inverse, so a model trained here can be saved for HF (and for `load_model`).

Must not import web/db code or the serving side; torch, safetensors and engine model modules only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model import CausalLM


class WeightLoadError(ValueError):
    """The checkpoint does not match the model built from its config.json."""


_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED_EXPERTS = re.compile(
    r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$"
)
_QKV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.([qkv])_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp(?:\.shared_expert)?)\.(gate|up)_proj\.(weight|bias)$")
_EXPERT_PART = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}
_SKIPPED = re.compile(r"rotary_emb\.inv_freq$")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, or every *.safetensors file."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with index.open(encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no safetensors weights in {model_dir}")
    return files


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)


def load_hf_weights(model: CausalLM, model_dir: str | Path) -> None:
    """Copy every tensor of the checkpoint into `model`; raise if anything is missing or unknown."""
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[str, int] = {}  # parameter name -> rows/experts written (coverage check)
    with torch.no_grad():
        for name, tensor in iter_checkpoint(model_dir):
            if _SKIPPED.search(name) or (name == "lm_head.weight" and model.config.tie_word_embeddings):
                continue  # tied: HF also ties lm_head to the embedding whatever the file says
            target, index = _map_name(name, model)
            if target not in params:
                raise WeightLoadError(f"checkpoint tensor {name!r} has no place in the model ({target!r})")
            dest = params[target] if index is None else params[target][index]
            if dest.shape != tensor.shape:
                raise WeightLoadError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled[target] = filled.get(target, 0) + tensor.numel()
    _check_coverage(model, params, filled)


def _check_coverage(model: CausalLM, params: dict[str, torch.nn.Parameter], filled: dict[str, int]) -> None:
    missing = []
    for name, p in params.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if filled.get(name, 0) != p.numel():
            missing.append(f"{name} ({filled.get(name, 0)}/{p.numel()} values)")
    if missing:
        raise WeightLoadError("checkpoint does not cover: " + ", ".join(missing))


def _map_name(name: str, model: CausalLM) -> tuple[str, tuple[int | slice, ...] | None]:
    """HF tensor name -> (our parameter name, index into it or None for the whole tensor)."""
    cfg = model.config
    if m := _EXPERT.match(name):
        layer, expert, part = m.group(1), int(m.group(2)), _EXPERT_PART.get(m.group(3))
        inter = cfg.moe_intermediate_size
        if part == "gate":
            return f"{layer}.mlp.experts.gate_up_proj", (expert, slice(0, inter))
        if part == "up":
            return f"{layer}.mlp.experts.gate_up_proj", (expert, slice(inter, 2 * inter))
        if part == "down":
            return f"{layer}.mlp.experts.down_proj", (expert,)
        raise WeightLoadError(f"unknown expert tensor {name!r}")
    if m := _FUSED_EXPERTS.match(name):
        return f"{m.group(1)}.mlp.experts.{m.group(2)}", None
    if m := _QKV.match(name):
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        start = {"q": 0, "k": q_size, "v": q_size + kv_size}[m.group(2)]
        size = q_size if m.group(2) == "q" else kv_size
        return f"{m.group(1)}.qkv_proj.{m.group(3)}", (slice(start, start + size),)
    if m := _GATE_UP.match(name):
        target = f"{m.group(1)}.gate_up_proj.{m.group(3)}"
        module = model.get_submodule(f"{m.group(1)}.gate_up_proj")
        assert isinstance(module, torch.nn.Linear)
        half = module.weight.shape[0] // 2
        rows = slice(0, half) if m.group(2) == "gate" else slice(half, 2 * half)
        return target, (rows,)
    return name.replace(".block_sparse_moe.", ".mlp."), None


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under HF names (per-expert tensors, separate q/k/v and gate/up), contiguous copies."""
    released = [name for name, p in model.named_parameters()
                if p.numel() > 1 and p.untyped_storage().nbytes() < p.numel() * p.element_size()]
    if released:
        raise RuntimeError(f"{released[0]} (and {len(released) - 1} more) hold no values of their own: they live only "
                           "in an inference backend's packed inference layout (an engine built with "
                           "release_weights=True); export from a model loaded with `load_model`")
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    q_size = cfg.num_attention_heads * cfg.head_dim
    kv_size = cfg.num_key_value_heads * cfg.head_dim
    moe_name = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for name, p in model.named_parameters():
        t = p.detach()
        if ".self_attn.qkv_proj." in name:
            prefix, kind = name.split(".qkv_proj.")
            for letter, part in zip("qkv", t.split([q_size, kv_size, kv_size]), strict=True):
                out[f"{prefix}.{letter}_proj.{kind}"] = part.contiguous()
        elif ".mlp.experts." in name:
            prefix = name.split(".mlp.experts.")[0] + f".{moe_name}.experts"
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.{names[0]}.weight"] = gate.contiguous()
                    out[f"{prefix}.{e}.{names[1]}.weight"] = up.contiguous()
                else:
                    out[f"{prefix}.{e}.{names[2]}.weight"] = t[e].contiguous()
        elif ".gate_up_proj." in name:
            prefix, kind = name.split(".gate_up_proj.")
            gate, up = t.chunk(2, dim=0)
            out[f"{prefix}.gate_proj.{kind}"] = gate.contiguous()
            out[f"{prefix}.up_proj.{kind}"] = up.contiguous()
        elif ".mlp.gate." in name and cfg.model_type == "mixtral":
            out[name.replace(".mlp.", ".block_sparse_moe.")] = t.contiguous()
        else:
            out[name] = t.contiguous()
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out
