"""Checkpoint loading: sharded files, fused expert tensors, tied embeddings, strict coverage, HF round trip."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig, ModelConfigError
from engine.model import load_model
from engine.weights import WeightLoadError, hf_state_dict
from tests.engine.hf_tiny import build_hf_model

PROMPT = torch.tensor([5, 17, 42, 99, 3, 150, 8])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(PROMPT, torch.arange(len(PROMPT)))


def _hf_logits(hf: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return hf(PROMPT[None]).logits[0]


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf = build_hf_model("mixtral", seed=21)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = load_model(tmp_path)
    torch.testing.assert_close(_logits(model), _hf_logits(hf), rtol=1e-4, atol=1e-5)


def test_fused_expert_tensors_load(tmp_path: Path) -> None:
    """transformers-5 in-memory layout: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    hf = build_hf_model("qwen3_moe", seed=22)
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if m := re.match(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name):
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
        else:
            fused[name] = t
    for prefix in {p for p, _ in experts}:
        stack = {part: torch.stack([v for _, v in sorted(experts[(prefix, part)].items())]) for part in
                 ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        fused[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        fused[f"{prefix}.down_proj"] = stack["down_proj"]
    save_file(fused, tmp_path / "model.safetensors")
    model, _ = load_model(tmp_path)
    torch.testing.assert_close(_logits(model), _hf_logits(hf), rtol=1e-4, atol=1e-5)


def test_tied_embeddings_stay_tied(tmp_path: Path) -> None:
    build_hf_model("qwen2", seed=23).save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "llama"])
def test_hf_state_dict_round_trips_through_transformers(family: str, tmp_path: Path) -> None:
    import transformers as tf

    src, dst = tmp_path / "src", tmp_path / "dst"
    hf = build_hf_model(family, seed=24)
    hf.save_pretrained(src)
    model, _ = load_model(src)
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(hf_state_dict(model), dst / "model.safetensors")
    saved, source = load_file(dst / "model.safetensors"), load_file(src / "model.safetensors")
    assert set(saved) == set(source)
    assert all(torch.equal(saved[name], source[name]) for name in source)  # the same tensors, bit for bit
    reloaded = tf.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    # the same weights through transformers twice: equal up to the CPU's matmul kernels, which may block a
    # product differently by the tensors' addresses (seen on an AVX2-only EPYC: 1.3e-6 on one logit of 1,120)
    torch.testing.assert_close(_hf_logits(reloaded), _hf_logits(hf), rtol=1e-5, atol=1e-5)


def test_missing_unknown_and_misshapen_tensors_are_rejected(tmp_path: Path) -> None:
    build_hf_model("olmoe", seed=25).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")

    missing = dict(tensors)
    del missing["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        load_model(tmp_path)

    save_file(
        {**tensors, "model.layers.0.mlp.mystery.weight": torch.zeros(2)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(WeightLoadError, match="mystery"):
        load_model(tmp_path)

    bad = dict(tensors)
    bad["model.norm.weight"] = torch.ones(3)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match=r"model\.norm\.weight"):
        load_model(tmp_path)


def test_unsupported_configs_are_rejected(tmp_path: Path) -> None:
    build_hf_model("llama", seed=26).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="unsupported model_type"):
        ModelConfig.from_hf_dict({**raw, "model_type": "gpt2"})
    with pytest.raises(ModelConfigError, match="hidden_act"):
        ModelConfig.from_hf_dict({**raw, "hidden_act": "gelu"})
    with pytest.raises(ModelConfigError, match="rope_type"):
        ModelConfig.from_hf_dict({**raw, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})


def test_family_config_normalisation(tmp_path: Path) -> None:
    build_hf_model("qwen2_moe", seed=27).save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size) == (8, 2, 48)
    assert cfg.sparse_layers == (True, False, True)  # mlp_only_layers=[1]
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.norm_topk_prob
    assert cfg.validate_experts_per_token(8) == 8
    with pytest.raises(ValueError, match="between 1 and 8"):
        cfg.validate_experts_per_token(0)


def test_legacy_sliding_layer_rules(tmp_path: Path) -> None:
    """Configs without `layer_types` follow each family's old default (as transformers' config classes do)."""
    build_hf_model("qwen2_moe", seed=28).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("layer_types")
    raw.update(use_sliding_window=True, sliding_window=7, max_window_layers=2)
    assert ModelConfig.from_hf_dict(raw).sliding_layers == (True, False, False)
    assert ModelConfig.from_hf_dict({**raw, "model_type": "qwen2"}).sliding_layers == (False, False, True)
    assert ModelConfig.from_hf_dict({**raw, "use_sliding_window": False}).sliding_window is None
