"""Byte-level BPE tokenizer for the demo models, trained with the `tokenizers` library.

Produces the Hugging Face files a real checkpoint ships: `tokenizer.json` (pre-tokenizer
with the Qwen2 split regex, so digits are single tokens, then byte-level BPE) and
`tokenizer_config.json` with the special tokens and a Qwen-style ChatML chat template.
Any byte sequence round-trips, so Chinese and emoji text encodes without unknown tokens.

Must not import torch, the gateway, the classifier or any web/db library.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.train.data import END_OF_TEXT, IM_END, IM_START, SPECIAL_TOKENS, SYSTEM_PROMPT

# The split regex of Qwen2's tokenizer.json: contractions, letter runs, single digits,
# punctuation runs, newlines, spaces.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '" + IM_START + "system\\n" + SYSTEM_PROMPT + IM_END + "\\n' }}"
    "{%- endif %}"
    "{{- '" + IM_START + "' + message['role'] + '\\n' + message['content'] + '" + IM_END + "' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '" + IM_START + "assistant\\n' }}{%- endif %}"
)


def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> Tokenizer:
    """Train byte-level BPE; the special tokens get ids 0, 1, 2 in `SPECIAL_TOKENS` order."""
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config(tok: Tokenizer, model_max_length: int) -> dict[str, object]:
    """The `tokenizer_config.json` of a Qwen2-style chat model."""
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": END_OF_TEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(tok, model_max_length), indent=2, ensure_ascii=False) + "\n",
        encoding="utf-8")


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        i = tok.token_to_id(t)
        if i is None:
            raise ValueError(f"tokenizer lacks special token {t}")
        ids[t] = i
    return ids
