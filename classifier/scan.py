"""One pass over the capped last user turn, shared by the hashed n-grams and every dense cue.

A prompt is tokenised once (one regular expression: words, numbers, LaTeX commands, money
amounts, CJK characters, symbols); the cues then read token and bigram counters (C-speed
``Counter`` lookups over small lexicons) instead of running one regular expression each,
which is what keeps a decision well under a millisecond.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

HEAD_CHARS = 2000
TAIL_CHARS = 500

# Common alternatives first (words, numbers) for speed. A currency sign before a number is a
# money token ("$#n2"), not a LaTeX delimiter; question marks are not tokens at all (they mark a
# question, not its difficulty: "Prove ...?" is no easier than "Prove ...").
_TOKEN = re.compile(r"[A-Za-z]+(?:'[a-z]+)?|\d+(?:[.,]\d+)*|\\[A-Za-z]+|\$\d+(?:[.,]\d+)*|"
                    r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]|[^\s\w?？]")
_CJK_FIRST, _CJK_LAST = "\u3040", "\ud7af"


def capped(text: str, head: int = HEAD_CHARS, tail: int = TAIL_CHARS) -> str:
    """The first ``head`` and last ``tail`` characters (the whole text when it is shorter)."""
    if len(text) <= head + tail:
        return text
    return text[:head] + "\n" + text[-tail:]


def number_shape(tok: str) -> str:
    """A number reduced to its shape: ``#n`` + digit count (max 6) + ``.`` if it has a separator."""
    digits = sum(c.isdigit() for c in tok)
    return "#n" + str(min(digits, 6)) + ("." if ("." in tok or "," in tok) else "")


class _Normalised(dict[str, str]):
    """raw token → normalised token (lower-case word, number shape, money shape), filled on first use."""

    def __missing__(self, tok: str) -> str:
        c = tok[0]
        if c.isdigit():
            out = number_shape(tok)
        elif c.isascii() and c.isalpha():
            out = tok.lower()
        elif c == "$" and len(tok) > 1:
            out = "$" + number_shape(tok[1:])
        else:
            out = tok
        if len(self) > CACHE_SIZE:
            self.clear()
        self[tok] = out
        return out


CACHE_SIZE = 1 << 18
_NORMALISED = _Normalised()
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyz")


def tokens(text: str) -> tuple[list[str], list[str]]:
    """(raw tokens, normalised tokens): words lower-cased, numbers as shapes, money as ``$`` + shape."""
    raw = _TOKEN.findall(text)
    return raw, list(map(_NORMALISED.__getitem__, raw))


@dataclass(frozen=True, slots=True)
class Lexicon:
    """Single words (matched as whole tokens), two-word phrases (matched as token bigrams) and
    longer phrases (substring counts on the lower-cased text); ``slot`` is its place in the
    per-scan count vector."""

    slot: int
    words: frozenset[str]
    pairs: frozenset[str] = frozenset()
    phrases: tuple[str, ...] = ()


_WORD_SLOTS: dict[str, list[int]] = {}
_PAIR_SLOTS: dict[str, list[int]] = {}
_PHRASES: list[tuple[str, int]] = []
_N_SLOTS = [0]


def lexicon(words: Iterable[str] = (), pairs: Iterable[str] = (), phrases: Iterable[str] = ()) -> Lexicon:
    """Register a lexicon (at import time of the module that defines it): every scan counts all
    registered lexicons in one pass over its distinct tokens and bigrams."""
    lex = Lexicon(_N_SLOTS[0], frozenset(words), frozenset(pairs), tuple(phrases))
    _N_SLOTS[0] += 1
    for w in lex.words:
        _WORD_SLOTS.setdefault(w, []).append(lex.slot)
    for p in lex.pairs:
        _PAIR_SLOTS.setdefault(p, []).append(lex.slot)
    _PHRASES.extend((p, lex.slot) for p in lex.phrases)
    return lex


class Scan:
    """Tokens and counters of one capped text (built once per prompt)."""

    __slots__ = ("_lexicon_counts", "bigram_counts", "bigrams", "lower", "n_words", "numbers", "raw", "text",
                 "token_counts", "toks", "words")

    def __init__(self, text: str) -> None:
        self.text = text
        self.lower = text.lower()
        self.raw, self.toks = tokens(text)
        self.bigrams = list(map(" ".join, zip(["^", *self.toks], self.toks, strict=False)))
        self.token_counts: Counter[str] = Counter(self.toks)
        self.bigram_counts: Counter[str] = Counter(self.bigrams)
        self.numbers = [r.lstrip("$") for r, t in zip(self.raw, self.toks, strict=True)
                        if t[:2] == "#n" or t[:3] == "$#n"]
        self.words = [t for t in self.toks if t[0] in _LETTERS]
        self.n_words = len(self.toks)
        self._lexicon_counts: list[int] | None = None

    def _fill(self) -> list[int]:
        counts = [0] * _N_SLOTS[0]
        tc, bc = self.token_counts, self.bigram_counts
        for t in tc.keys() & _WORD_SLOTS.keys():
            for slot in _WORD_SLOTS[t]:
                counts[slot] += tc[t]
        for p in bc.keys() & _PAIR_SLOTS.keys():
            for slot in _PAIR_SLOTS[p]:
                counts[slot] += bc[p]
        for phrase, slot in _PHRASES:
            counts[slot] += self.lower.count(phrase)
        self._lexicon_counts = counts
        return counts

    def count(self, lex: Lexicon) -> int:
        """How often the lexicon's words, pairs and phrases occur."""
        counts = self._lexicon_counts if self._lexicon_counts is not None else self._fill()
        return counts[lex.slot]

    def cjk(self) -> int:
        if max(self.text, default="\0") < _CJK_FIRST:
            return 0
        return sum(1 for t in self.toks if len(t) == 1 and _CJK_FIRST <= t <= _CJK_LAST)
