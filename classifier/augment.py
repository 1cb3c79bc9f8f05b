"""Synthetic-but-honest coverage: system prompts and multi-turn conversations built from
the labelled prompts themselves, each keeping the label of its last user turn.

The label answers "how hard is the *last user turn*", so wrapping a prompt in a generic
system prompt, or putting another prompt of the same source before it, leaves the label
true without inventing one. This teaches the model that a system prompt is not a
difficulty signal, and lets the context features (``c:`` n-grams, turn counts) see data.
Every ``EVERY``-th prompt of a source gets one variant (alternating system / multi-turn),
deterministically. No Chinese variants: translating would need a model, and labels for
translated text would be a guess.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from classifier.types import LabelledExample, Message

EVERY = 20
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise expert. Answer accurately and keep it short.",
    "You are a friendly tutor. Format your answer in Markdown.",
    "Respond as a careful assistant; if something is ambiguous, state your assumptions.",
)
ASSISTANT_REPLY = "Here is my answer to that."


def _variant(ex: LabelledExample, i: int, previous: LabelledExample | None) -> LabelledExample:
    last: list[Message] = [m for m in (ex.messages or []) if m.get("role") == "user"][-1:]
    if i % 2 == 0 or previous is None:
        messages: list[Message] = [{"role": "system", "content": SYSTEM_PROMPTS[(i // 2) % len(SYSTEM_PROMPTS)]},
                                   *last]
        kind = "system"
    else:
        prev = [m for m in (previous.messages or []) if m.get("role") == "user"][-1:]
        messages = [*prev, {"role": "assistant", "content": ASSISTANT_REPLY}, *last]
        kind = "multi_turn"
    return LabelledExample(tier=ex.tier, score=ex.score, source=ex.source, messages=messages, weight=ex.weight,
                           meta={"augmented": kind})


def augment(examples: Sequence[LabelledExample], every: int = EVERY) -> list[LabelledExample]:
    """The variants (not the originals) for every ``every``-th conversation example of each source;
    a multi-turn variant's earlier turn is the previous prompt of the same source."""
    out: list[LabelledExample] = []
    count: dict[str, int] = {}
    last_of: dict[str, LabelledExample] = {}
    for ex in examples:
        if ex.messages is None:
            continue
        k = count.get(ex.source, 0)
        count[ex.source] = k + 1
        if k % every == every - 1:
            out.append(_variant(ex, k // every, last_of.get(ex.source)))
        last_of[ex.source] = ex
    return out
