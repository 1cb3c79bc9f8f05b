"""The GGUF side that needs no torch: opening a file, its metadata, and its tokenizer as a HF tokenizer.

`tokenizer_json` rebuilds a ``tokenizer.json`` from ``tokenizer.ggml.*`` (``model == "gpt2"``: byte-level
BPE from the vocabulary and merges, the pre-tokenizer split named by ``tokenizer.ggml.pre``; CONTROL tokens
special, USER_DEFINED tokens added); a file that embeds ``tokenizer.huggingface.json`` uses that.
`load_gguf_tokenizer` adds the special tokens, EOS/EOT ids and chat template (`engine.tokenizer` builds its
`Tokenizer` from them). The model side is `engine.gguf`.

Must not import torch, the model, or anything web/db: json, gguf and tokenizers only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# tokenizer.ggml.pre -> the split regex of its HF tokenizer (llama.cpp's llama-vocab.cpp lists the same)
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT,
                        "smaug-bpe": _LLAMA3_SPLIT, "olmo": None, "default": None, "gpt-2": None}


class GGUFError(ValueError):
    """A GGUF file this engine cannot run (family, tensor type, tokenizer) or that does not match its config."""


def reader(path: str | Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path), "r")
    except (OSError, ValueError) as exc:
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from exc


def fields(reader: Any) -> dict[str, Any]:
    """Every metadata field as a Python value (strings decoded, arrays as lists)."""
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        out[name] = field.contents()
    return out


# --- the tokenizer ------------------------------------------------------------------------------------------

def tokenizer_json(meta: dict[str, Any]) -> dict[str, Any]:
    """A HF ``tokenizer.json`` for a GGUF file's tokenizer (byte-level BPE; see the module docstring)."""
    embedded = meta.get("tokenizer.huggingface.json")
    if embedded:
        return dict(json.loads(embedded))
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"GGUF tokenizer model {model!r} is not supported (byte-level BPE, 'gpt2', is)")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZER_SPLITS)}")
    split = PRE_TOKENIZER_SPLITS[pre]
    byte_level: dict[str, Any] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                  "use_regex": split is None}
    pre_tokenizer = byte_level if split is None else {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}, byte_level]}
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] == 3}
             for i, tok in enumerate(tokens) if types[i] in (3, 4)]  # CONTROL, USER_DEFINED
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre_tokenizer, "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }


def load_gguf_tokenizer(path: str | Path) -> tuple[Any, dict[str, str], str | None, list[int]]:
    """(a `tokenizers.Tokenizer`, special tokens by role, the chat template, EOS ids) of a GGUF file."""
    from tokenizers import Tokenizer as HFTokenizer

    meta = fields(reader(path))
    hf = HFTokenizer.from_str(json.dumps(tokenizer_json(meta)))
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    special: dict[str, str] = {}
    for role, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < len(tokens):
            special[role] = tokens[int(value)]
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if meta.get(k) is not None]
    return hf, special, meta.get("tokenizer.chat_template"), eos
