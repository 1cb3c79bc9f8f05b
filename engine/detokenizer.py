"""Incremental detokenization for streaming, with stop strings.

Text is released only once the tokens decoded so far form whole characters (a byte-level
BPE token can end in the middle of a UTF-8 sequence; the decoder then yields U+FFFD and we
wait for the next token). Decoding re-reads a short window of recent tokens, so a
tokenizer whose pieces depend on their left neighbour (leading-space markers) still
produces the same text as a one-shot decode.

Stop strings: the text is cut just before the first stop string, which is not returned.
While streaming, the last ``len(longest stop) - 1`` characters are held back, so text
that turns out to be the start of a stop string is never sent.

Pure Python: takes a ``decode(list[int]) -> str`` callable; imports no torch, no model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        tail = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = tail
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._emitted = 0
        self.text = ""
        self.stopped = False

    def add_token(self, token_id: int) -> bool:
        """Feed one generated token; returns True when a stop string has been reached."""
        if self.stopped:
            return True
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._append(full[len(prefix):])
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self.stopped

    def flush(self) -> None:
        """At the end of generation, release whatever is pending (even an incomplete character)."""
        if self.stopped or self._read_offset == len(self._ids):
            return
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix):
            self._append(full[len(prefix):])
        self._read_offset = len(self._ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out that is safe to send now (everything once finished)."""
        upto = len(self.text) if finished or self.stopped else max(len(self.text) - self._holdback, 0)
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted:upto]
        self._emitted = upto
        return delta

    def _append(self, delta: str) -> None:
        start = max(len(self.text) - self._holdback, 0)
        self.text += delta
        cut = -1
        for s in self._stop:
            i = self.text.find(s, start)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            self.text = self.text[:cut]
            self.stopped = True
