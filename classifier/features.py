"""Cheap features for the effort classifier: hashed word/CJK n-grams plus hand features.

Everything here is plain Python + numpy so that one prompt costs well under a
millisecond: the n-gram part reads at most ``HEAD_CHARS`` + ``TAIL_CHARS`` characters of
the last user turn (so a 100k-character prompt costs about as much as a 4k one), the
hand features use C-speed ``str.count``/``len`` on the full text. Hashing uses CRC-32,
which is stable across processes (Python's ``hash`` is salted).

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from classifier.cues import CUE_NAMES, difficulty_cues
from classifier.types import Message, SparseFeatures

FEATURE_VERSION = "f2"
N_HASH = 1 << 18
HEAD_CHARS = 3000
TAIL_CHARS = 1000
SYSTEM_CHARS = 400
CONTEXT_CHARS = 400

DENSE_NAMES: tuple[str, ...] = (
    "log_chars", "log_words", "digit_share", "log_numbers", "max_number_digits", "math_symbols",
    "latex", "code_markers", "question_marks", "reasoning_cues", "constraints", "prior_user_turns",
    "assistant_turns", "system_present", "log_system_chars", "cjk_share", "newlines", "sentences",
    "choices", "truncated", "list_items", "log_context_chars", *CUE_NAMES,
)
N_DENSE = len(DENSE_NAMES)
N_FEATURES = N_DENSE + N_HASH

_TOKEN = re.compile(r"\\[A-Za-z]+|[A-Za-z]+(?:'[a-z]+)?|\d+(?:[.,]\d+)*|[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]|[^\s\w]")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")
_CHOICES = re.compile(r"(?:^|\s)\(?[A-Ea-e][).:]\s")
_LIST_ITEM = re.compile(r"(?m)^\s*(?:[-*•]|\d+[.)])\s")
_SENTENCE_END = re.compile(r"[.!?。！？](?:\s|$)")
_REASONING_CUES = ("prove", "explain", "why", "derive", "show that", "step by step", "calculate",
                   "compute", "optimi", "algorithm", "complexity", "analy", "design", "implement",
                   "evaluate", "compare", "justify", "证明", "解释", "计算", "分析", "为什么")
_CONSTRAINTS = ("must", "at least", "at most", "exactly", "without", "only", "ensure", "should not",
                "no more than", "constraint", "require", "format", "必须", "至少", "不超过")
_CODE_MARKERS = ("```", "def ", "class ", "return", ";\n", "{", "}", "()", "=>", "import ", "#include",
                 "function", "int ", "print(")
_MATH_CHARS = "+-*/=^<>%×÷≤≥√∑∫π"


def _content_text(content: Any) -> str:
    """Text of an OpenAI message content: a string or a list of typed parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    return str(content)


def split_conversation(messages: Sequence[Message]) -> tuple[str, str, str, int, int]:
    """(last user turn, system text, earlier-context text, earlier user turns, assistant turns)."""
    system: list[str] = []
    users: list[str] = []
    assistant_turns = 0
    for m in messages:
        role = m.get("role")
        text = _content_text(m.get("content"))
        if role in ("system", "developer"):
            system.append(text)
        elif role == "user":
            users.append(text)
        elif role == "assistant":
            assistant_turns += 1
    if not users:  # no user turn: classify whatever text there is
        users = [_content_text(m.get("content")) for m in messages if m.get("role") not in ("system", "developer")]
        users = users or [""]
    prompt = users[-1]
    context = users[-2] if len(users) > 1 else ""
    return prompt, "\n".join(system), context, len(users) - 1, assistant_turns


def _capped(text: str, head: int, tail: int) -> str:
    if len(text) <= head + tail:
        return text
    return text[:head] + "\n" + text[-tail:]


def _bucket(token: str) -> int:
    return N_DENSE + (zlib.crc32(token.encode("utf-8")) & (N_HASH - 1))


def _number_shape(tok: str) -> str:
    digits = sum(c.isdigit() for c in tok)
    return "#n" + str(min(digits, 6)) + ("." if ("." in tok or "," in tok) else "")


def _tokens(text: str) -> list[str]:
    out = []
    for tok in _TOKEN.findall(text):
        c = tok[0]
        if c.isdigit():
            out.append(_number_shape(tok))
        elif c.isascii() and c.isalpha():
            out.append(tok.lower())
        else:
            out.append(tok)
    return out


def _count_any(text: str, needles: tuple[str, ...]) -> int:
    return sum(text.count(n) for n in needles)


def _dense(prompt: str, capped: str, lower: str, system: str, context: str, prior_users: int,
           assistant_turns: int, n_words: int) -> list[float]:
    n = max(len(capped), 1)
    numbers = _NUMBER.findall(capped)
    max_digits = max((len(x) for x in numbers), default=0)
    cjk = len(_CJK.findall(capped))
    return [
        math.log1p(len(prompt)) / 12.0,
        math.log1p(n_words) / 10.0,
        sum(ch.isdigit() for ch in capped) / n,
        math.log1p(len(numbers)) / 5.0,
        math.log1p(max_digits) / 3.0,
        math.log1p(sum(capped.count(ch) for ch in _MATH_CHARS)) / 5.0,
        math.log1p(capped.count("\\") + capped.count("$")) / 5.0,
        math.log1p(_count_any(capped, _CODE_MARKERS)) / 5.0,
        math.log1p(capped.count("?") + capped.count("？")) / 3.0,
        math.log1p(_count_any(lower, _REASONING_CUES)) / 3.0,
        math.log1p(_count_any(lower, _CONSTRAINTS)) / 3.0,
        math.log1p(prior_users) / 3.0,
        math.log1p(assistant_turns) / 3.0,
        1.0 if system.strip() else 0.0,
        math.log1p(len(system)) / 10.0,
        cjk / n,
        math.log1p(capped.count("\n")) / 5.0,
        math.log1p(len(_SENTENCE_END.findall(capped))) / 4.0,
        1.0 if len(_CHOICES.findall(capped)) >= 2 else 0.0,
        1.0 if len(prompt) > HEAD_CHARS + TAIL_CHARS else 0.0,
        math.log1p(len(_LIST_ITEM.findall(capped))) / 3.0,
        math.log1p(len(context)) / 10.0,
        *difficulty_cues(capped, lower),
    ]


def extract(messages: Sequence[Message]) -> SparseFeatures:
    """Hashed sparse features of one conversation (the last user turn plus context signals)."""
    prompt, system, context, prior_users, assistant_turns = split_conversation(messages)
    capped = _capped(prompt, HEAD_CHARS, TAIL_CHARS)
    toks = _tokens(capped)
    counts: dict[int, float] = {}
    prev = "^"
    for tok in toks:
        for key in (tok, prev + " " + tok):
            b = _bucket(key)
            counts[b] = counts.get(b, 0.0) + 1.0
        prev = tok
    for tok in _tokens(system[:SYSTEM_CHARS]):
        b = _bucket("s:" + tok)
        counts[b] = counts.get(b, 0.0) + 1.0
    for tok in _tokens(context[:CONTEXT_CHARS]):
        b = _bucket("c:" + tok)
        counts[b] = counts.get(b, 0.0) + 1.0
    hashed = {b: math.log1p(v) for b, v in counts.items()}
    norm = math.sqrt(sum(v * v for v in hashed.values())) or 1.0
    dense = _dense(prompt, capped, capped.lower(), system, context, prior_users, assistant_turns, len(toks))
    indices = list(range(N_DENSE)) + sorted(hashed)
    values = dense + [hashed[b] / norm for b in sorted(hashed)]
    return SparseFeatures(tuple(indices), tuple(values), FEATURE_VERSION)


def to_arrays(features: SparseFeatures) -> tuple[np.ndarray, np.ndarray]:
    """(indices int64, values float32) views of a feature vector, for fast dot products."""
    return np.asarray(features.indices, dtype=np.int64), np.asarray(features.values, dtype=np.float32)


def token_names(messages: Sequence[Message]) -> dict[int, str]:
    """Column index → human-readable feature name for one conversation (used by `explain`)."""
    prompt, system, context, _, _ = split_conversation(messages)
    names: dict[int, str] = {i: "dense:" + n for i, n in enumerate(DENSE_NAMES)}
    prev = "^"
    for tok in _tokens(_capped(prompt, HEAD_CHARS, TAIL_CHARS)):
        names.setdefault(_bucket(tok), tok)
        names.setdefault(_bucket(prev + " " + tok), prev + " " + tok)
        prev = tok
    for tok in _tokens(system[:SYSTEM_CHARS]):
        names.setdefault(_bucket("s:" + tok), "s:" + tok)
    for tok in _tokens(context[:CONTEXT_CHARS]):
        names.setdefault(_bucket("c:" + tok), "c:" + tok)
    return names
