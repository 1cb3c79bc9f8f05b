"""Difficulty cues that are not length: reasoning words, maths/LaTeX density, number
magnitude, constraint and code structure, vocabulary rarity, question shape.

These dense features exist so that the score can rank a short hard prompt ("Prove that
sqrt(2) is irrational.") above a long easy one: every value is a density, a flag or a
log-count of a cue, not a size. They read the shared ``Scan`` (token and bigram counters),
so each lexicon costs a few dictionary lookups.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import math
import re

from classifier.scan import Scan, lexicon

CUE_NAMES: tuple[str, ...] = (
    "proof_cues", "counting_cues", "optimise_cues", "quantifier_cues", "solve_cues", "explain_cues",
    "creative_cues", "factoid_shape", "yes_no_shape", "latex_density", "operator_density",
    "log_max_number", "number_density", "bounds_notation", "code_structure", "long_word_share",
    "mean_word_len", "imperative_start", "short_prompt",
)

PROOF = lexicon(("prove", "proves", "proof", "disprove", "derive", "lemma", "theorem", "irrational", "iff",
                 "justify"), ("show that", "demonstrate that", "证 明"), ("if and only if",))
COUNTING = lexicon(("probability", "arrangements", "combinations", "permutations", "mod", "modulo"),
                   ("many ways", "many different", "of ways", "of distinct", "expected value", "many positive",
                    "many integers", "remainder when"))
OPTIMISE = lexicon(("optimal", "optimize", "optimise", "optimization", "optimisation", "minimum", "maximum",
                    "minimize", "minimise", "maximize", "maximise", "smallest", "largest", "efficient",
                    "efficiently"),
                   ("least possible", "greatest possible", "time complexity", "space complexity", "o (",
                    "最 小", "最 大"))
QUANTIFIER = lexicon(("satisfy", "satisfies", "satisfying"),
                     ("for all", "for every", "for each", "there exists", "there exist", "find all",
                      "determine all", "all real", "all positive", "all integers", "such that", "in terms"))
SOLVE = lexicon(("solve", "compute", "calculate", "evaluate", "simplify", "determine", "integral", "derivative",
                 "matrix", "polynomial", "equation", "equations", "求"), ("the value", "计 算"))
EXPLAIN = lexicon(("explain", "why", "compare", "analyze", "analyse", "analysis", "tradeoff", "design",
                   "implement", "debug", "reason", "reasoning"),
                  ("step by", "trade off", "为 什", "分 析"))
CREATIVE = lexicon(("poem", "story", "email", "letter", "tweet", "slogan", "haiku", "joke", "song", "rewrite",
                    "paraphrase", "translate", "summarize", "summarise", "summary", "suggest", "recommend"),
                   ("give me", "tell me", "write a"))
BOUNDS = lexicon(("constraint", "constraints", "≤", "≥", "\\le", "\\leq", "\\ge", "\\geq"),
                 ("< =", "> =", "#n2 ^"))
CODE = lexicon(("def", "class", "return", "function", "nums", "array", "input", "output"),
               ("= >", "# include", "string s"), ("```",))
LATEX_OPS = lexicon(("\\le", "\\ge", "\\leq", "\\geq", "\\cdot", "\\times", "\\frac", "\\sqrt"))
OPERATORS = lexicon(tuple("+-*/=^<>%×÷≤≥√∑∫π"))

_FACTOID = re.compile(r"^\s*(?:who|when|where|what year|what is the name|what's the name|which country|which city|"
                      r"who's|what is the capital|how old|how tall|how long ago|in which|in what year)\b", re.I)
_YES_NO = re.compile(r"^\s*(?:is|are|was|were|do|does|did|can|could|has|have|will)\s", re.I)
_IMPERATIVE = re.compile(r"^\s*(?:write|create|generate|make|give|list|name|tell|suggest|describe|translate|"
                         r"rewrite|summari[sz]e|classify|convert|correct|fix)\b", re.I)


def _number_value(tok: str) -> float:
    try:
        return float(tok.replace(",", ""))
    except ValueError:
        return 0.0


def indented_lines(text: str) -> int:
    return sum(1 for line in text.split("\n") if line.startswith("    ") and line.strip())


def difficulty_cues(scan: Scan) -> list[float]:
    """Dense cue values in CUE_NAMES order for a scanned (capped) last user turn."""
    text = scan.text
    n = max(len(text), 1)
    tc = scan.token_counts
    nw = max(len(scan.words), 1)
    numbers = scan.numbers
    biggest = max((_number_value(x) for x in numbers[:200]), default=0.0)
    head = text[:200]
    latex = text.count("\\") + tc.get("$", 0)
    operators = scan.count(OPERATORS) + scan.count(LATEX_OPS)
    lengths = list(map(len, scan.words))
    return [
        math.log1p(scan.count(PROOF)),
        math.log1p(scan.count(COUNTING)),
        math.log1p(scan.count(OPTIMISE)),
        math.log1p(scan.count(QUANTIFIER)),
        math.log1p(scan.count(SOLVE)),
        math.log1p(scan.count(EXPLAIN)),
        math.log1p(scan.count(CREATIVE)),
        1.0 if nw <= 25 and _FACTOID.match(head) else 0.0,
        1.0 if nw <= 25 and _YES_NO.match(head) else 0.0,
        min(latex / nw, 2.0),
        min(10.0 * operators / n, 2.0),
        math.log10(1.0 + biggest) / 6.0 if biggest < 1e30 else 5.0,
        min(len(numbers) / nw, 2.0),
        math.log1p(scan.count(BOUNDS)),
        math.log1p(scan.count(CODE) + (indented_lines(text) if "\n    " in text else 0)),
        sum(map((8).__lt__, lengths)) / nw,
        (sum(lengths) / nw) / 10.0,
        1.0 if _IMPERATIVE.match(head) else 0.0,
        1.0 if len(scan.words) <= 12 else 0.0,
    ]
