"""engine.tokenizer against transformers: encode/decode, chat templates (file and config forms), streaming text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.tokenizer import ChatTemplateError, Tokenizer

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Héllo wörld, naïve café — 東京 and emoji 🦊🐶 mixed in. ",
    "def add(a, b):\n    return a + b\n",
]
# ChatML with the features real templates use: loop.first, raise_exception, tojson, bos_token, tools.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be first') }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  2+2?  "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": 'Ünïcode & <html> "quotes"'},
    ],
]


def _raw_tokenizer() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_raw_tokenizer(), bos_token="<s>", eos_token="<|im_end|>")
    fast.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return fast, path


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(hf_dir: tuple[Any, Path], add_generation_prompt: bool) -> None:
    fast, path = hf_dir
    ours = Tokenizer.from_dir(path)
    for messages in CONVERSATIONS:
        expected = fast.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
        expected_ids = fast.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        assert ours.encode_chat(messages, add_generation_prompt) == list(expected_ids)


def test_tools_render_through_tojson(hf_dir: tuple[Any, Path]) -> None:
    fast, path = hf_dir
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter <heute>"}}]
    messages = CONVERSATIONS[0]
    expected = fast.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert Tokenizer.from_dir(path).apply_chat_template(messages, tools=tools) == expected
    assert "Wetter <heute>" in expected  # not HTML-escaped


def test_reasoning_fields_are_aliased_like_transformers(hf_dir: tuple[Any, Path], tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    _, path = hf_dir
    template = "{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content }}|{{ m.content }}]{% endfor %}"
    (tmp_path / "tokenizer.json").write_bytes((path / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "because"},
        {"role": "assistant", "content": "b", "thinking": "hmm"},
    ]
    expected = PreTrainedTokenizerFast.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False)
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(messages, add_generation_prompt=False) == expected
    assert "because" in expected and "hmm" in expected


def test_template_in_tokenizer_config_and_raise_exception(hf_dir: tuple[Any, Path], tmp_path: Path) -> None:
    _, path = hf_dir
    (tmp_path / "tokenizer.json").write_bytes((path / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": TEMPLATE})
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template(CONVERSATIONS[0]).startswith("<s><|im_start|>user\nHi there")
    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    with pytest.raises(ChatTemplateError, match="System message must be first"):
        tok.apply_chat_template(bad)


def test_no_template_is_a_clear_error(hf_dir: tuple[Any, Path], tmp_path: Path) -> None:
    _, path = hf_dir
    (tmp_path / "tokenizer.json").write_bytes((path / "tokenizer.json").read_bytes())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATIONS[0])


def test_encode_decode_and_eos_ids_match_transformers(hf_dir: tuple[Any, Path]) -> None:
    fast, path = hf_dir
    tok = Tokenizer.from_dir(path)
    text = "Héllo wörld 🦊 東京 <|im_end|>"
    assert tok.encode(text) == fast.encode(text)
    ids = tok.encode(text)
    assert tok.decode(ids) == fast.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == fast.decode(ids)
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"), 1)


def test_incremental_detokenizer_streams_exact_text(hf_dir: tuple[Any, Path]) -> None:
    _, path = hf_dir
    tok = Tokenizer.from_dir(path)
    prompt = tok.encode("Say: ")
    generated = tok.encode("naïve 🦊🐶 café, 東京!\n    return a + b")
    assert any("\ufffd" in tok.decode([i]) for i in generated)  # some tokens are partial UTF-8
    stream = tok.detokenizer(prompt)
    deltas = [stream.add(i) for i in generated]
    deltas.append(stream.flush())
    assert "".join(deltas) == tok.decode(generated)
    assert all("\ufffd" not in d for d in deltas)
