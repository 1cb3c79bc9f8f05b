"""MODEL_CARD.md for a trained demo model, written from what the training run measured.

Every number in the card comes from the run that wrote it (parameter counts, steps, wall
time, validation perplexity of the saved bf16 checkpoint); nothing is typed in by hand.

Must not import the gateway, the classifier or any web/db library.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.train.data import CorpusSplit

if TYPE_CHECKING:
    from engine.train.recipe import DemoRecipe, ModelResult

LICENCES = {
    "gsm8k": ("openai/grade-school-math, train.jsonl", "MIT"),
    "math": ("microsoft/ToRA copy of Hendrycks MATH test (MATH_test_5000.jsonl)", "MIT"),
    "mbpp": ("google-research mbpp (mbpp.jsonl)", "CC BY 4.0"),
    "self_instruct": ("yizhongw/self-instruct (seed + user-oriented tasks)", "Apache-2.0"),
    "nq_open": ("google-research-datasets/natural-questions nq_open dev + efficientqa dev", "CC BY-SA 3.0"),
    "arc": ("AllenAI ARC Easy/Challenge *Train* via nju-websoft/GenMC", "CC BY-SA 4.0"),
    "leetcode": ("newfacade/LeetCodeDataset train (trimmed)", "MIT (problem text is LeetCode's)"),
    "shakespeare": ("karpathy/char-rnn tinyshakespeare", "public domain text; repo MIT"),
}


def _fmt(n: int) -> str:
    return f"{n:,} ({n / 1e6:.2f} M)"


def render_model_card(result: ModelResult, recipe: DemoRecipe, corpus: CorpusSplit,
                      tokens: tuple[int, int], hardware: str) -> str:
    c: dict[str, Any] = result.hf_config
    is_moe = "num_local_experts" in c
    rep = result.report
    lines = [
        f"# {result.name}: tiergate's bundled demo {'sparse-MoE' if is_moe else 'dense draft'} model",
        "",
        "**Demo quality.** This model was trained from scratch in minutes on two shared CPU cores. It "
        "produces ChatML-formatted, topical-looking text (arithmetic-style worked answers, Python snippets, "
        "Shakespeare-like verse) but its answers are usually wrong. It exists so that tiergate runs end to "
        "end with no network and no API keys, and so the engine's MoE paths (experts per token, paged KV "
        "cache, speculative decoding) have a real trained checkpoint to run on. Point the tiers at a real "
        "model for anything else (see the README).",
        "",
        "## Architecture",
        "",
        f"- Family: `{c['model_type']}` (`{c['architectures'][0]}` in Hugging Face transformers); "
        f"weights `model.safetensors` in bfloat16 with HF tensor names.",
        f"- {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} attention "
        f"heads ({c['num_key_value_heads']} KV heads, head_dim {c['head_dim']}), RoPE θ={c['rope_theta']}, "
        f"context {c['max_position_embeddings']} tokens, vocabulary {c['vocab_size']}.",
    ]
    if is_moe:
        lines.append(f"- {c['num_local_experts']} experts per layer (SwiGLU, width {c['intermediate_size']}), "
                     f"router softmax top-{c['num_experts_per_tok']} renormalised (Mixtral rule). Trained with "
                     f"experts-per-token drawn per step from {result.train_config['k_choices']} with weights "
                     f"{result.train_config['k_weights']}, so k=1 works as well as the default k=2.")
    else:
        lines.append(f"- Dense SwiGLU MLP width {c['intermediate_size']}; same tokenizer as demo-moe, meant as "
                     "the draft model for speculative decoding.")
    lines += ["", "## Parameters", "", f"- Total: {_fmt(result.params_total)}"]
    for k, n in sorted(result.params_active.items()):
        label = f"Active per token at k={k}" if k else "Active per token"
        lines.append(f"- {label}: {_fmt(n)}")
    lines += [
        "",
        "## Validation perplexity",
        "",
        f"Held-out records ({len(corpus.validation)} records, {tokens[1]:,} tokens; "
        f"{recipe.validation_fraction:.0%} of every source, split by record with seed {recipe.seed}), "
        f"windows of {recipe.context} tokens, bf16 checkpoint as shipped, loaded by `engine.model.load_model`:",
        "",
        "| experts per token | perplexity |",
        "|---|---|",
    ]
    for k, ppl in sorted(result.val_ppl.items()):
        lines.append(f"| {k if k else 'dense'} | {ppl:.2f} |")
    k_flags = " ".join(f"--k {k}" for k in sorted(result.val_ppl) if k)
    lines += [
        "",
        "Measured by:",
        "",
        "```sh",
        f"tiergate engine eval-ppl --model engine/models/{result.name} {k_flags}".rstrip(),
        "```",
        "",
        "## Training",
        "",
        f"- Steps: {rep.steps} (stopped by {rep.stopped_by}), {rep.tokens:,} tokens seen "
        f"({rep.tokens / max(1, tokens[0]):.2f} epochs of {tokens[0]:,} training tokens); final train loss "
        f"{rep.final_loss:.3f}.",
        f"- Wall time: {rep.seconds / 60:.1f} min on {hardware} (a 2-core machine shared with other jobs).",
        f"- Optimiser: AdamW (β 0.9/0.95, weight decay {result.train_config['weight_decay']}), peak lr "
        f"{result.train_config['lr']}, {result.train_config['warmup_steps']} warm-up steps, cosine to "
        f"{result.train_config['min_lr_fraction']}× peak; {result.train_config['batch_size']} windows of "
        f"{result.train_config['seq_len']} tokens per step; gradient clip {result.train_config['grad_clip']}"
        + (f"; router balance loss coefficient {result.train_config['balance_coef']}." if is_moe else "."),
        f"- Seeds: data split {recipe.seed}, training {result.train_config['seed']}.",
        f"- Trained {dt.date.today().isoformat()}.",
        "",
        "Re-create both bundled models (corpus, tokenizer, weights, this card) from the shared data folder:",
        "",
        "```sh",
        train_command(recipe),
        "```",
        "",
        "Runs are deterministic for a fixed number of steps. A wall-clock cap (`--minutes`, "
        "`--draft-minutes`) stops training early and also advances the cosine learning-rate decay by "
        "elapsed time, so a capped run ends annealed but depends on the machine's speed; the step count "
        "above is what this run reached.",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE trained with Hugging Face `tokenizers` on the training split ({c['vocab_size']} tokens, "
        "Qwen2 pre-tokenizer regex, so digits are single tokens). Special tokens `<|endoftext|>`, "
        "`<|im_start|>`, `<|im_end|>`; ChatML chat template in `tokenizer_config.json` (Qwen style).",
        "",
        "## Data",
        "",
        "Question → worked answer chats (ChatML) from the shared datasets, plus Shakespeare passages as plain "
        "text. Licences as listed in the shared data folder's MANIFEST.md. Evaluation splits (GSM8K test, "
        "HumanEval, the Qwen math evaluation sets, ARC Dev/Test, NQ-open test) were not used. Note that MATH "
        "*test* problems (which include MATH-500) are in the training data, so do not report MATH scores of "
        "this model as held out.",
        "",
        "| source | train records | validation records | origin | licence |",
        "|---|---|---|---|---|",
    ]
    for source, (n_train, n_val) in corpus.sources().items():
        origin, licence = LICENCES.get(source, ("", ""))
        lines.append(f"| {source} | {n_train} | {n_val} | {origin} | {licence} |")
    lines.append("")
    return "\n".join(lines)


def train_command(recipe: DemoRecipe) -> str:
    """The `tiergate engine train` command line that re-creates this recipe."""
    parts = ["tiergate engine train --out engine/models --data-dir ../shared/data",
             f"--moe-steps {recipe.moe.steps} --draft-steps {recipe.draft.steps}"]
    if recipe.moe.max_minutes:
        parts.append(f"--minutes {recipe.moe.max_minutes:g}")
    if recipe.draft.max_minutes:
        parts.append(f"--draft-minutes {recipe.draft.max_minutes:g}")
    if recipe.moe.threads:
        parts.append(f"--threads {recipe.moe.threads}")
    if recipe.seed != 1234:
        parts.append(f"--seed {recipe.seed}")
    return " ".join(parts)


def write_model_card(out_dir: Path, result: ModelResult, recipe: DemoRecipe, corpus: CorpusSplit,
                     tokens: tuple[int, int], hardware: str) -> None:
    (Path(out_dir) / "MODEL_CARD.md").write_text(
        render_model_card(result, recipe, corpus, tokens, hardware), encoding="utf-8")
