"""The recipe for the bundled demo models: their HF configs, seeds and training settings.

`train_demo_models` re-creates `engine/models/demo-moe` (a Mixtral-family sparse MoE,
8 experts, top-2, trained with experts-per-token drawn from {1, 2}) and
`engine/models/demo-draft` (a dense Llama-family draft model with the same tokenizer)
from the shared data folder. Everything random is seeded from `DemoRecipe.seed`.

Must not import the gateway, the classifier or any web/db library.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.train.data import SPECIAL_TOKENS, CorpusSplit, build_corpus
from engine.train.loop import TrainConfig, TrainReport, perplexity, train
from engine.train.tokenizer_train import save_tokenizer, special_token_ids, train_tokenizer

MOE_DIR = "demo-moe"
DRAFT_DIR = "demo-draft"


def moe_hf_config(vocab_size: int, eos_id: int, pad_id: int, *, hidden: int = 256, layers: int = 4,
                  experts: int = 8, top_k: int = 2, expert_width: int = 256, context: int = 1024) -> dict[str, Any]:
    """A Mixtral `config.json` (HF names), loadable by `MixtralForCausalLM` and by `engine.model`."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": expert_width,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": hidden // 8,
        "num_local_experts": experts,
        "num_experts_per_tok": top_k,
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "sliding_window": None,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "router_aux_loss_coef": 0.01,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


def draft_hf_config(vocab_size: int, eos_id: int, pad_id: int, *, hidden: int = 256, layers: int = 2,
                    width: int = 512, context: int = 1024) -> dict[str, Any]:
    """A dense Llama `config.json` for the speculative-decoding draft model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": hidden // 8,
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


def generation_config(eos_ids: list[int], pad_id: int) -> dict[str, Any]:
    return {"eos_token_id": eos_ids, "pad_token_id": pad_id, "do_sample": True,
            "temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.05}


@dataclass(frozen=True)
class DemoRecipe:
    data_dir: Path
    out_dir: Path
    seed: int = 1234
    validation_fraction: float = 0.02
    vocab_size: int = 4096
    context: int = 1024
    moe: TrainConfig = field(default_factory=lambda: TrainConfig(seq_len=1024, batch_size=2, steps=1500,
                                                                  lr=2e-3, warmup_steps=100))
    draft: TrainConfig = field(default_factory=lambda: TrainConfig(seq_len=1024, batch_size=2, steps=1000,
                                                                    lr=2e-3, warmup_steps=100,
                                                                    k_choices=(1,), k_weights=(1.0,)))
    moe_shape: dict[str, int] = field(default_factory=dict)     # overrides for moe_hf_config (tests: tiny)
    draft_shape: dict[str, int] = field(default_factory=dict)   # overrides for draft_hf_config
    eval_windows: int | None = None                             # cap validation windows (tests)
    which: tuple[str, ...] = (MOE_DIR, DRAFT_DIR)


@dataclass
class ModelResult:
    name: str
    report: TrainReport
    params_total: int
    params_active: dict[int, int]
    val_ppl: dict[int, float]
    hf_config: dict[str, Any]
    train_config: dict[str, Any]


def encode_split(tok: Any, corpus: CorpusSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the encoded documents of each split into one int32 token stream."""
    def stream(docs: list[Any]) -> torch.Tensor:
        if not docs:
            return torch.zeros(0, dtype=torch.int32)
        encs = tok.encode_batch([d.text for d in docs])
        flat = [i for e in encs for i in e.ids]
        return torch.tensor(flat, dtype=torch.int32)
    return stream(corpus.train), stream(corpus.validation)


def train_demo_models(recipe: DemoRecipe, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build corpus and tokenizer, train the models in `recipe.which`, write them with model cards."""
    from engine.train.card import write_model_card
    from engine.train.export import active_parameters, build_model, save_checkpoint

    started = time.time()
    corpus = build_corpus(recipe.data_dir, recipe.validation_fraction, recipe.seed)
    log(f"corpus: {len(corpus.train)} train / {len(corpus.validation)} validation records")
    tok = train_tokenizer((_plain(d.text) for d in corpus.train), recipe.vocab_size)
    ids = special_token_ids(tok)
    train_ids, val_ids = encode_split(tok, corpus)
    log(f"tokens: {train_ids.numel()} train / {val_ids.numel()} validation")
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    specs = {
        MOE_DIR: (moe_hf_config(tok.get_vocab_size(), eos, pad, context=recipe.context, **recipe.moe_shape),
                  replace(recipe.moe, seed=recipe.seed)),
        DRAFT_DIR: (draft_hf_config(tok.get_vocab_size(), eos, pad, context=recipe.context, **recipe.draft_shape),
                    replace(recipe.draft, seed=recipe.seed + 1)),
    }
    results: dict[str, Any] = {}
    for name in recipe.which:
        hf_config, cfg = specs[name]
        out = recipe.out_dir / name
        save_tokenizer(tok, out, recipe.context)
        (out / "generation_config.json").write_text(
            json.dumps(generation_config([eos, pad], pad), indent=2) + "\n", encoding="utf-8")
        torch.manual_seed(cfg.seed)
        model = build_model(hf_config)
        n_experts = hf_config.get("num_local_experts")
        log(f"{name}: {sum(p.numel() for p in model.parameters())} parameters; training {cfg}")
        def checkpoint(step: int, m: torch.nn.Module = model, c: dict[str, Any] = hf_config,
                       o: Path = out) -> None:
            save_checkpoint(m, c, o)

        report = train(model, train_ids, cfg, num_experts=n_experts, log=log, checkpoint=checkpoint)
        ks = [1, 2] if n_experts else [0]
        _round_to(model, torch.bfloat16)   # evaluate exactly the weights that were saved
        ppl = {k: perplexity(model, val_ids, recipe.context, k or None, recipe.eval_windows) for k in ks}
        log(f"{name}: validation perplexity {ppl}")
        result = ModelResult(name, report, sum(p.numel() for p in model.parameters()),
                             {k: active_parameters(hf_config, k) for k in ks}, ppl, hf_config, asdict(cfg))
        write_model_card(out, result, recipe, corpus, tokens=(train_ids.numel(), val_ids.numel()),
                         hardware=_hardware())
        results[name] = result
    log(f"done in {time.time() - started:.0f}s")
    return results


def _round_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(p.dtype))


def _plain(text: str) -> str:
    """Special tokens are added whole; keep their spelling out of the BPE merges."""
    for sp in SPECIAL_TOKENS:
        text = text.replace(sp, "\n")
    return text


def _hardware() -> str:
    return f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def checkpoint_perplexity(model_dir: str | Path, data_dir: str | Path, ks: list[int | None],
                          seed: int = 1234, validation_fraction: float = 0.02,
                          max_windows: int | None = None) -> dict[int | None, float]:
    """Validation perplexity of a saved checkpoint, loaded by `engine.model.load_model`, per expert count.

    The validation split is rebuilt from the data folder with the recipe's seed, and encoded with the
    checkpoint's own tokenizer; windows are the model's context length.
    """
    from tokenizers import Tokenizer

    from engine.model import load_model

    model, config = load_model(model_dir)
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    corpus = build_corpus(data_dir, validation_fraction, seed)
    _, val_ids = encode_split(tok, CorpusSplit(train=[], validation=corpus.validation))
    return {k: perplexity(model, val_ids, config.max_position_embeddings, k, max_windows) for k in ks}
