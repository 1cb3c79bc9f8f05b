"""Training of the bundled demo models: corpus, tokenizer, loop, export, model card.

Public API: `DemoRecipe` / `train_demo_models` (what `tiergate engine train` runs),
`checkpoint_perplexity` (what `tiergate engine eval-ppl` runs), and the building blocks
`build_corpus`, `train_tokenizer`, `TrainConfig`, `train`, `perplexity`, `build_model`,
`save_checkpoint`. Importing this package loads torch but builds nothing.
Must not import the gateway, the classifier or any web/db library.
"""

from engine.train.data import CorpusSplit, Document, build_corpus, chat_text
from engine.train.export import active_parameters, build_model, save_checkpoint
from engine.train.loop import TrainConfig, TrainReport, perplexity, train
from engine.train.recipe import (
    DRAFT_DIR,
    MOE_DIR,
    DemoRecipe,
    ModelResult,
    checkpoint_perplexity,
    draft_hf_config,
    moe_hf_config,
    train_demo_models,
)
from engine.train.tokenizer_train import CHAT_TEMPLATE, save_tokenizer, train_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "DRAFT_DIR",
    "MOE_DIR",
    "CorpusSplit",
    "DemoRecipe",
    "Document",
    "ModelResult",
    "TrainConfig",
    "TrainReport",
    "active_parameters",
    "build_corpus",
    "build_model",
    "chat_text",
    "checkpoint_perplexity",
    "draft_hf_config",
    "moe_hf_config",
    "perplexity",
    "save_checkpoint",
    "save_tokenizer",
    "train",
    "train_demo_models",
    "train_tokenizer",
]
