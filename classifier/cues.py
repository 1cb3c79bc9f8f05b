"""Difficulty cues that are not length: reasoning words, maths/LaTeX density, number
magnitude, constraint and code structure, vocabulary rarity, question shape.

These dense features exist so that the score can rank a short hard prompt ("Prove that
sqrt(2) is irrational.") above a long easy one: every value is a density, a flag or a
log-count of a cue, not a size. Plain Python on the capped text; under ~0.1 ms a prompt.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import math
import re

CUE_NAMES: tuple[str, ...] = (
    "proof_cues", "counting_cues", "optimise_cues", "quantifier_cues", "solve_cues", "explain_cues",
    "creative_cues", "factoid_shape", "yes_no_shape", "latex_density", "operator_density",
    "log_max_number", "number_density", "bounds_notation", "code_structure", "long_word_share",
    "mean_word_len", "imperative_start", "short_prompt",
)

_PROOF = ("prove", "show that", "derive", "demonstrate that", "justify", "disprove", "lemma", "theorem",
          "irrational", "if and only if", "iff", "证明")
_COUNTING = ("how many ways", "how many different", "number of ways", "number of distinct", "probability",
             "expected value", "how many positive", "how many integers", "arrangements", "combinations",
             "permutations", "remainder when", "mod ")
_OPTIMISE = ("optimal", "minimum", "maximum", "minimi", "maximi", "smallest", "largest", "least possible",
             "greatest possible", "time complexity", "space complexity", "efficient", "o(n", "最小", "最大")
_QUANTIFIER = ("for all", "for every", "for each", "there exists", "find all", "determine all", "all real",
               "all positive", "all integers", "such that", "in terms of", "satisfy", "satisfies")
_SOLVE = ("solve", "compute", "calculate", "evaluate", "simplify", "find the value", "determine", "integral",
          "derivative", "matrix", "polynomial", "equation", "求", "计算")
_EXPLAIN = ("explain", "why", "compare", "analy", "trade-off", "tradeoff", "design", "implement", "debug",
            "step by step", "reason", "为什么", "分析")
_CREATIVE = ("write a story", "write a poem", "poem", "story", "email", "letter", "tweet", "slogan", "haiku",
             "joke", "song", "rewrite", "paraphrase", "translate", "summar", "list ", "suggest", "recommend",
             "give me", "tell me", "name ")
_FACTOID = re.compile(r"^\s*(?:who|when|where|what year|what is the name|what's the name|which country|which city|"
                      r"who's|what is the capital|how old|how tall|how long ago|in which|in what year)\b", re.I)
_YES_NO = re.compile(r"^\s*(?:is|are|was|were|do|does|did|can|could|has|have|will)\s", re.I)
_IMPERATIVE = re.compile(r"^\s*(?:write|create|generate|make|give|list|name|tell|suggest|describe|translate|"
                         r"rewrite|summari[sz]e|classify|convert|correct|fix)\b", re.I)
_LATEX = re.compile(r"\\[A-Za-z]+|\$")
_OPERATOR = re.compile(r"[+\-*/=^<>%×÷≤≥√∑∫π]|\\le|\\ge|\\cdot|\\times|\\frac|\\sqrt")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_BOUNDS = re.compile(r"10\^|1e\d|<=|>=|≤|≥|\\le|\\ge|\bconstraints?\b", re.I)
_CODE = re.compile(r"```|\bdef |\bclass |\breturn\b|=>|#include|\bfunction\b|^\s{4}\S|\bnums\b|\barray\b|"
                   r"\bstring s\b|\binput\b|\boutput\b", re.M)
_WORD = re.compile(r"[A-Za-z]+")


def _count(text: str, needles: tuple[str, ...]) -> int:
    return sum(text.count(n) for n in needles)


def difficulty_cues(capped: str, lower: str) -> list[float]:
    """Dense cue values in CUE_NAMES order for the (capped) last user turn and its lower-case."""
    n = max(len(capped), 1)
    words = _WORD.findall(capped)
    nw = max(len(words), 1)
    numbers = _NUMBER.findall(capped)
    biggest = max((float(x) for x in numbers[:200]), default=0.0)
    head = capped[:200]
    return [
        math.log1p(_count(lower, _PROOF)),
        math.log1p(_count(lower, _COUNTING)),
        math.log1p(_count(lower, _OPTIMISE)),
        math.log1p(_count(lower, _QUANTIFIER)),
        math.log1p(_count(lower, _SOLVE)),
        math.log1p(_count(lower, _EXPLAIN)),
        math.log1p(_count(lower, _CREATIVE)),
        1.0 if _FACTOID.match(head) and nw <= 25 else 0.0,
        1.0 if _YES_NO.match(head) and nw <= 25 else 0.0,
        min(len(_LATEX.findall(capped)) / nw, 2.0),
        min(10.0 * len(_OPERATOR.findall(capped)) / n, 2.0),
        math.log10(1.0 + biggest) / 6.0 if biggest < 1e30 else 5.0,
        min(len(numbers) / nw, 2.0),
        math.log1p(len(_BOUNDS.findall(capped))),
        math.log1p(len(_CODE.findall(capped))),
        sum(1 for w in words if len(w) >= 9) / nw,
        (sum(len(w) for w in words) / nw) / 10.0,
        1.0 if _IMPERATIVE.match(head) else 0.0,
        1.0 if nw <= 12 else 0.0,
    ]
