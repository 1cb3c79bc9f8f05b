"""Cheap features for the effort classifier: hashed word/CJK n-grams plus hand features.

Everything here is plain Python + numpy so that one prompt costs well under a
millisecond: the last user turn is capped to ``HEAD_CHARS`` + ``TAIL_CHARS`` characters
(so a 100k-character prompt costs about as much as a 2.5k one) and tokenised once
(``classifier.scan``); the n-grams and every dense cue read that one scan. Sizes (length,
turns, system prompt) use the full text. Hashing uses CRC-32, which is stable across
processes (Python's ``hash`` is salted), behind a bounded cache of token → column.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from classifier.cues import CREATIVE, CUE_NAMES, PROOF, SOLVE, difficulty_cues
from classifier.reasoning import COUNT_Q, REASONING_NAMES, STATE_CHANGE, STYLE, reasoning_cues
from classifier.scan import HEAD_CHARS, TAIL_CHARS, Scan, capped, lexicon, tokens
from classifier.structure import STRUCTURE_NAMES, structure_cues
from classifier.types import Message, SparseFeatures

FEATURE_VERSION = "f4"
N_HASH = 1 << 18
SYSTEM_CHARS = 400
CONTEXT_CHARS = 400
BUCKET_CACHE_SIZE = 1 << 19  # token → column entries kept before the cache is cleared

CONTEXT_NAMES: tuple[str, ...] = ("context_maths", "context_code", "context_reasoning", "context_style")
DENSE_NAMES: tuple[str, ...] = (
    "log_chars", "log_words", "digit_share", "log_numbers", "max_number_digits", "math_symbols",
    "latex", "code_markers", "currency", "reasoning_cues", "constraints", "prior_user_turns",
    "assistant_turns", "system_present", "log_system_chars", "cjk_share", "newlines", "sentences",
    "choices", "truncated", "list_items", "log_context_chars", *CONTEXT_NAMES, *CUE_NAMES, *REASONING_NAMES,
    *STRUCTURE_NAMES,
)
N_DENSE = len(DENSE_NAMES)
N_FEATURES = N_DENSE + N_HASH

REASONING_WORDS = lexicon(("prove", "explain", "why", "derive", "calculate", "compute", "optimize", "optimise",
                           "optimal", "algorithm", "complexity", "analyze", "analyse", "analysis", "design",
                           "implement", "evaluate", "compare", "justify"),
                          ("show that", "step by", "证 明", "解 释", "计 算", "分 析", "为 什"))
CONSTRAINT_WORDS = lexicon(("must", "exactly", "without", "only", "ensure", "constraint", "constraints", "require",
                            "requires", "required", "format", "必", "至"),
                           ("at least", "at most", "should not", "no more"))
CODE_MARKERS = ("```", "def ", "class ", "return", ";\n", "{", "}", "()", "=>", "import ", "#include",
                "function", "int ", "print(")
MATH_CHARS = "+-*/=^<>%×÷≤≥√∑∫π"
MATH_SYMBOLS = lexicon(tuple(MATH_CHARS))
CURRENCY_WORDS = lexicon(("dollars", "dollar", "cents", "cent", "euros", "euro", "pounds", "€", "£", "¥"))
OPTION_START = ("a.", "b.", "c.", "d.", "e.", "(a)", "(b)", "(c)", "(d)", "(e)", "a)", "b)", "c)", "d)", "e)",
                "a:", "b:", "c:", "d:")
INLINE_OPTIONS = lexicon((), ("( a", "( b", "( c", "( d", "( e"))


class _Buckets(dict[str, int]):
    """token → hashed column, filled on first use (CRC-32 of the UTF-8 bytes)."""

    def __missing__(self, key: str) -> int:
        value = N_DENSE + (zlib.crc32(key.encode("utf-8")) & (N_HASH - 1))
        self[key] = value
        return value


_BUCKETS = _Buckets()


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


def _count_any(text: str, needles: tuple[str, ...]) -> int:
    return sum(text.count(n) for n in needles)


def _options(text: str, scan: Scan) -> int:
    """Lines that start like a lettered option ("A. ...", "(B) ...") plus inline "(a)" markers."""
    lines = sum(1 for line in text.split("\n") if line.lstrip()[:3].lower().startswith(OPTION_START))
    return lines + scan.count(INLINE_OPTIONS)


def _list_items(text: str) -> int:
    n = 0
    for line in text.split("\n"):
        s = line.lstrip()
        if s[:2] in ("- ", "* ", "• ") or (s[:1].isdigit() and s[1:3] in (". ", ") ")):
            n += 1
    return n


def _sentences(text: str) -> int:
    return (sum(text.count(p) for p in (". ", "! ", "? ", ".\n", "!\n", "?\n", "。", "！", "？"))
            + (1 if text.rstrip()[-1:] in (".", "!", "?") else 0))


def _context_cues(context: str) -> list[float]:
    """A few cues of the previous user turn: what the conversation is about."""
    if not context.strip():
        return [0.0] * len(CONTEXT_NAMES)
    scan = Scan(context[:CONTEXT_CHARS])
    symbols = scan.count(MATH_SYMBOLS) + scan.text.count("\\")
    return [math.log1p(symbols + len(scan.numbers)) / 3.0,
            math.log1p(_count_any(scan.text, CODE_MARKERS)) / 3.0,
            math.log1p(scan.count(PROOF) + scan.count(SOLVE) + scan.count(STATE_CHANGE) + scan.count(COUNT_Q)) / 2.0,
            math.log1p(scan.count(STYLE) + scan.count(CREATIVE)) / 2.0]


def _dense(prompt: str, scan: Scan, system: str, context: str, prior_users: int, assistant_turns: int) -> list[float]:
    text = scan.text
    n = max(len(text), 1)
    latex_dollars = scan.token_counts.get("$", 0)  # a "$" before a number is money, any other is LaTeX
    numbers = scan.numbers
    max_digits = max((len(x) for x in numbers), default=0)
    return [
        math.log1p(len(prompt)) / 12.0,
        math.log1p(scan.n_words) / 10.0,
        sum(map(len, numbers)) / n,
        math.log1p(len(numbers)) / 5.0,
        math.log1p(max_digits) / 3.0,
        math.log1p(scan.count(MATH_SYMBOLS)) / 5.0,
        math.log1p(text.count("\\") + latex_dollars) / 5.0,
        math.log1p(_count_any(text, CODE_MARKERS)) / 5.0,
        math.log1p(text.count("$") - latex_dollars + scan.count(CURRENCY_WORDS)) / 3.0,
        math.log1p(scan.count(REASONING_WORDS)) / 3.0,
        math.log1p(scan.count(CONSTRAINT_WORDS)) / 3.0,
        math.log1p(prior_users) / 3.0,
        math.log1p(assistant_turns) / 3.0,
        1.0 if system.strip() else 0.0,
        math.log1p(len(system)) / 10.0,
        scan.cjk() / n,
        math.log1p(text.count("\n")) / 5.0,
        math.log1p(_sentences(text)) / 4.0,
        1.0 if _options(text, scan) >= 2 else 0.0,
        1.0 if len(prompt) > HEAD_CHARS + TAIL_CHARS else 0.0,
        math.log1p(_list_items(text)) / 3.0,
        math.log1p(len(context)) / 10.0,
        *_context_cues(context),
        *difficulty_cues(scan),
        *reasoning_cues(scan),
        *structure_cues(text),
    ]


def extract_arrays(messages: Sequence[Message]) -> tuple[np.ndarray, np.ndarray]:
    """(column indices int64, values float32) of one conversation: the request path's form."""
    prompt, system, context, prior_users, assistant_turns = split_conversation(messages)
    scan = Scan(capped(prompt))
    if len(_BUCKETS) > BUCKET_CACHE_SIZE:
        _BUCKETS.clear()
    get = _BUCKETS.__getitem__
    cols = list(map(get, scan.toks))
    cols += map(get, scan.bigrams)
    if system:
        cols += map(get, ["s:" + t for t in tokens(system[:SYSTEM_CHARS])[1]])
    if context:
        cols += map(get, ["c:" + t for t in tokens(context[:CONTEXT_CHARS])[1]])
    counts = Counter(cols)
    hashed_idx = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    hashed_val = np.log1p(np.fromiter(counts.values(), dtype=np.float64, count=len(counts)))
    hashed_val /= float(np.sqrt(hashed_val @ hashed_val)) or 1.0
    order = np.argsort(hashed_idx)
    dense = _dense(prompt, scan, system, context, prior_users, assistant_turns)
    idx = np.concatenate([np.arange(N_DENSE, dtype=np.int64), hashed_idx[order]])
    val = np.concatenate([np.asarray(dense, dtype=np.float64), hashed_val[order]])
    return idx, val.astype(np.float32)


def extract(messages: Sequence[Message]) -> SparseFeatures:
    """Hashed sparse features of one conversation (the last user turn plus context signals)."""
    idx, val = extract_arrays(messages)
    return SparseFeatures(tuple(idx.tolist()), tuple(val.tolist()), FEATURE_VERSION)


def to_arrays(features: SparseFeatures) -> tuple[np.ndarray, np.ndarray]:
    """(indices int64, values float32) views of a feature vector, for fast dot products."""
    return np.asarray(features.indices, dtype=np.int64), np.asarray(features.values, dtype=np.float32)


def token_names(messages: Sequence[Message]) -> dict[int, str]:
    """Column index → human-readable feature name for one conversation (used by `explain`)."""
    prompt, system, context, _, _ = split_conversation(messages)
    names: dict[int, str] = {i: "dense:" + n for i, n in enumerate(DENSE_NAMES)}
    scan = Scan(capped(prompt))
    for key in (*scan.toks, *scan.bigrams):
        names.setdefault(_BUCKETS[key], key)
    for tok in tokens(system[:SYSTEM_CHARS])[1]:
        names.setdefault(_BUCKETS["s:" + tok], "s:" + tok)
    for tok in tokens(context[:CONTEXT_CHARS])[1]:
        names.setdefault(_BUCKETS["c:" + tok], "c:" + tok)
    return names
