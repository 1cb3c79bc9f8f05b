"""Structure cues: the *shape* of a prompt that asks for a chain of small steps.

Where thinking first pays, the prompt usually describes a state and a sequence of changes to it
(a shuffle of objects, a walk, a chain of who-says-who-lies, a list of items to count, a word
problem): many short sentences, the same names and objects mentioned again and again, each
sentence sharing words with the one before, sentences of parallel form ("Alice has ... Bob has
... Claire has ..."). Where it does not pay — recall, judgement of tone or style, a translation
or a single long argument — the prompt reads as ordinary prose: longer sentences, fewer repeats,
a high ratio of distinct words.

Each cue is a share, a mean or a log-count in [0, ~1.5]; none names a task, a benchmark or a
word list, so what is learned on one set of tasks can carry to word problems, exams or chat.
One pass of one regular expression over the capped text (the ``Scan``'s), a few microseconds.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import math
import re
from collections import Counter

STRUCTURE_NAMES: tuple[str, ...] = (
    "distinct_word_share", "repeated_names", "short_sentence_share", "parallel_sentences", "max_word_repeat",
    "sentence_overlap", "log_sentence_count",
)

# Words and sentence ends; "?" ends a sentence here (the scan drops it as a token).
_WORD_OR_END = re.compile(r"[A-Za-z]+|[.!?]+(?=\s|$)|\n")
SHORT_SENTENCE_WORDS = 8
LONG_WORD = 4  # words of at least this many letters carry content (sentence overlap, repeats)
# Capitalised words that are sentence furniture, not names.
_NOT_NAMES = frozenset(("the", "a", "an", "i", "if", "then", "what", "which", "who", "is", "at", "in", "on", "it",
                        "options", "q", "and", "but", "so", "there", "this", "that", "we", "you", "he", "she",
                        "they", "how", "when", "where", "why", "answer", "question", "let", "for", "of", "to"))


def structure_cues(text: str) -> list[float]:
    """Cue values in STRUCTURE_NAMES order for a (capped) last user turn."""
    sentences: list[list[str]] = []
    current: list[str] = []
    for tok in _WORD_OR_END.findall(text):
        c = tok[0]
        if c.isalpha():
            current.append(tok)
        elif current:
            sentences.append(current)
            current = []
    if current:
        sentences.append(current)
    if not sentences:
        return [0.0] * len(STRUCTURE_NAMES)
    words = [w.lower() for s in sentences for w in s]
    counts = Counter(words)
    n_words = len(words)
    names = Counter(w for s in sentences for w in s if w[0].isupper())
    repeated_names = sum(1 for w, k in names.items() if k >= 2 and w.lower() not in _NOT_NAMES)
    n = len(sentences)
    short = sum(1 for s in sentences if len(s) <= SHORT_SENTENCE_WORDS)
    starts = Counter(s[0].lower() for s in sentences)
    parallel = sum(k for k in starts.values() if k >= 2)
    max_repeat = max((k for w, k in counts.items() if len(w) >= LONG_WORD), default=0)
    overlaps = []
    prev: set[str] | None = None
    for s in sentences:
        content = {w.lower() for w in s if len(w) >= LONG_WORD}
        if prev and content:
            overlaps.append(len(content & prev) / len(content | prev))
        prev = content
    return [
        len(counts) / n_words,
        math.log1p(repeated_names) / 3.0,
        short / n,
        parallel / n,
        math.log1p(max_repeat) / 4.0,
        sum(overlaps) / len(overlaps) if overlaps else 0.0,
        math.log1p(n) / 4.0,
    ]
