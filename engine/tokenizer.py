"""Tokenizer of a HF model directory: `tokenizer.json` via HF `tokenizers`, chat template rendered like HF.

The chat template comes from `chat_template.jinja` or `tokenizer_config.json` (`chat_template`, a string
or a list of named templates) and is rendered in a jinja2 `ImmutableSandboxedEnvironment` with the same
settings and helpers as `transformers` (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`,
`strftime_now`, a non-escaping `tojson`), with the special tokens (`bos_token`, `eos_token`, ...) in scope.
`IncrementalDetokenizer` turns a growing token list into text deltas that never split a UTF-8 character.

Must not import torch, the model, or anything web/db.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template rejected the conversation (`raise_exception`)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        ids: list[int] = []
        eos = special_tokens.get("eos_token")
        if eos is not None and (eos_id := tokenizer.token_to_id(eos)) is not None:
            ids.append(eos_id)
        ids.extend(i for i in extra_eos_token_ids if i not in ids)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """From a model directory (tokenizer.json, tokenizer_config.json) or a GGUF file (`engine.gguf`)."""
        model_dir = Path(model_dir)
        if model_dir.suffix == ".gguf":
            from engine.gguf_vocab import load_gguf_tokenizer

            tok, special, chat_template, eos = load_gguf_tokenizer(model_dir)
            return cls(tok, special, chat_template, eos)
        tokenizer = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        special = {k: v for k in SPECIAL_TOKEN_KEYS if (v := _token_content(cfg.get(k))) is not None}
        template = _chat_template(model_dir, cfg)
        extra: list[int] = []
        for name in ("generation_config.json", "config.json"):
            value = _read_json(model_dir / name).get("eos_token_id")
            extra.extend(value if isinstance(value, list) else [] if value is None else [value])
        return cls(tokenizer, special, template, [int(i) for i in extra])

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")
        return compile_chat_template(self.chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the conversation as HF `apply_chat_template(..., tokenize=False)` does."""
        context = {**self.special_tokens, **kwargs}
        try:
            return str(
                self._compiled_template.render(
                    messages=[_alias_reasoning(m) for m in messages],
                    tools=tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **context,
                )
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation (the template already holds any special tokens)."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Streams text for generated tokens: `add(token_id)` returns the new text (possibly empty).

    Decodes a short window of recent tokens and emits only the suffix past what was already emitted; text
    ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the next token completes it.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)[-6:]  # context so the first tokens decode with correct spacing
        self._prefix_offset = 0
        self._read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix = self._tok.decode(self.ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self.ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a trailing incomplete character at the end of generation)."""
        full = self._tok.decode(self.ids[self._prefix_offset :], self._skip)
        prefix = self._tok.decode(self.ids[self._prefix_offset : self._read_offset], self._skip)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self.ids)
        self.text += delta
        return delta


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """As transformers does: a message's reasoning is visible as `reasoning_content` and `thinking`."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return dict(message)
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _chat_template(model_dir: Path, cfg: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
