"""Test helper: a tiny random Mixtral plus a trained byte-level BPE tokenizer with a ChatML
template, saved as a model directory the local engine loads (config.json, safetensors,
tokenizer.json, tokenizer_config.json). No network."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tests.engine.hf_tiny import build_hf_model, save_hf_model

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog. ", "Héllo wörld, naïve café — 東京 🦊. ",
          "What is two plus two? Four. "]
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 400


def write_tiny_model(path: Path, seed: int = 3, max_positions: int = 256) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_hf_model(build_hf_model("mixtral", seed=seed, vocab_size=VOCAB, max_position_embeddings=max_positions),
                  path)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    return path
