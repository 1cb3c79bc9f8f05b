"""A tiny, deterministic labelled set for fast classifier tests (no shared data needed).

Four kinds of prompt with clearly different difficulty, each kind spread over two sources
so that grouped splits still see every tier in training.
"""

from __future__ import annotations

import random

from classifier import LabelledExample, user_prompt

CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Seoul", "Rome", "Accra", "Hanoi", "Bern", "Riga"]
THINGS = ["apples", "marbles", "books", "coins", "pens", "cards", "shells", "stamps"]
FILLER = ["please", "quickly", "today", "carefully", "thanks", "friend", "kindly", "again", "now", "here",
          "exactly", "briefly", "also", "really", "simply", "clearly"]


def _trivia(r: random.Random) -> str:
    return f"Which country is {r.choice(CITIES)} the capital of?"


def _arith(r: random.Random) -> str:
    a, b = r.randint(2, 90), r.randint(2, 90)
    return f"Tom has {a} {r.choice(THINGS)} and buys {b} more. How many does he have now?"


def _code(r: random.Random) -> str:
    return (f"Write a Python function `f{r.randint(1, 999)}(xs)` that returns the longest strictly increasing "
            f"subsequence of a list of {r.randint(5, 50)} integers. Explain its complexity.")


def _olympiad(r: random.Random) -> str:
    n = r.randint(3, 40)
    return (f"Prove that for every integer $n \\geq {n}$ the sum $\\sum_{{k=1}}^{{n}} \\frac{{1}}{{k^2}} < 2 - "
            f"\\frac{{1}}{{n}}$, and determine all $n$ for which $n^{{{n % 7 + 2}}} + {n} \\equiv 0 \\pmod{{{n + 1}}}$.")


KINDS = (("none", 0.05, _trivia), ("low", 0.25, _arith), ("medium", 0.55, _code), ("xhigh", 0.9, _olympiad))


def tiny_dataset(per_kind: int = 40, seed: int = 0) -> list[LabelledExample]:
    """``per_kind`` prompts of each kind; the score varies a little inside a kind (by the
    prompt's length) so that scores are not all tied within a cluster."""
    r = random.Random(seed)
    out = []
    for i in range(per_kind):
        for tier, score, make in KINDS:
            extra = r.randint(0, 6)
            text = make(r) + " " + " ".join(r.sample(FILLER, extra))
            jitter = extra / 100
            out.append(LabelledExample(tier=tier, score=score + jitter, source=f"src{i % 3}",
                                       messages=user_prompt(text)))
    return out


def prompts_of(kind: int, n: int, seed: int = 1) -> list[str]:
    r = random.Random(seed)
    return [KINDS[kind][2](r) for _ in range(n)]
