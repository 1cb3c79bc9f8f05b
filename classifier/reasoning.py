"""Cues for "does extra reasoning pay here": the kinds of work where thinking first helps a
model (multi-step computation, tracking state through a sequence of changes, counting,
chains of logic, ordering constraints, date and time arithmetic, symbol manipulation)
against the kinds where it does not (recall, style, taste, sarcasm, translation).

Each value is a flag, a density or a log-count of a *kind of demand*, never a size, and no
cue names a benchmark: the lexicons are general English (state-change verbs, sequence
markers, comparatives, truth words), so a weight learned on one set of tasks can carry to
word problems, exams or chat. They read the shared ``Scan``.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import math
import re

from classifier.scan import Scan, lexicon

REASONING_NAMES: tuple[str, ...] = (
    "sequence_markers", "state_changes", "count_question", "quantity_question", "arith_chain", "paren_depth",
    "truth_logic", "connectives", "ordering_relations", "ordinal_positions", "time_arithmetic",
    "entity_names", "number_words", "numbers_in_story", "multi_constraint", "recall_shape", "style_taste",
    "language_form", "opinion_shape",
)


def _inflect(*stems: str) -> list[str]:
    """A verb stem with its -s / -ed forms (regular verbs only; irregular forms are listed)."""
    out = []
    for s in stems:
        base = s[:-1] if s.endswith("e") else s
        out += [s, s + "s", base + "ed", base + "ing"]
    return out


SEQUENCE = lexicon(("first", "then", "next", "afterwards", "afterward", "finally", "subsequently", "later",
                    "meanwhile", "eventually"),
                   ("after that", "the end", "step #n1", "round #n1", "then ,"))
STATE_CHANGE = lexicon((*_inflect("swap", "trade", "switch", "exchange", "move", "remove", "add", "gain", "earn",
                                  "share", "split", "double", "triple", "halve", "increase", "decrease", "place",
                                  "use", "fill", "pour", "return", "rotate", "flip", "shuffle", "replace"),
                        "swapped", "give", "gives", "gave", "given", "take", "takes", "took", "taken", "lose",
                        "loses", "lost", "buy", "buys", "bought", "sell", "sells", "sold", "spend", "spends",
                        "spent", "pay", "pays", "paid", "put", "puts", "eat", "eats", "ate", "left"),
                       ("turn left", "turn right", "turn around", "turns left", "turns right", "step forward",
                        "steps forward", "step backward", "steps backward", "steps left", "steps right"))
COUNT_Q = lexicon(("count", "counts", "counted", "counting", "altogether", "total"),
                  ("how many", "number of", "in total", "in all"))
QUANTITY_Q = lexicon(("remain", "remains", "remaining", "average", "per"),
                     ("how much", "how long", "how far", "how old", "how fast", "left over", "the total", "the sum",
                      "the difference", "the product", "the average", "the remainder"))
TRUTH = lexicon(("true", "false", "lie", "lies", "lied", "liar", "liars", "truthful", "knight", "knights", "knave",
                 "knaves", "valid", "invalid", "contradiction", "contradicts", "contradictory", "consistent",
                 "inconsistent", "implies", "implied", "entails", "entail", "deduce", "deduced", "deduction",
                 "infer", "inferred", "inference"),
                ("the truth",))
CONNECTIVES = lexicon(("if", "then", "unless", "either", "neither", "nor", "not", "and", "or", "therefore",
                       "hence", "because", "whenever", "otherwise"))
ORDERING = lexicon(("above", "below", "before", "after", "behind", "between"),
                   ("left of", "right of", "earlier than", "later than", "older than", "younger than",
                    "taller than", "shorter than", "more than", "less than", "fewer than", "greater than",
                    "cheaper than", "heavier than", "faster than", "ahead of", "bigger than", "smaller than"))
ORDINALS = lexicon(("leftmost", "rightmost", "oldest", "newest", "youngest", "cheapest", "tallest", "shortest"),
                   ("first from", "second from", "third from", "fourth from", "fifth from", "last place",
                    "most expensive", "least expensive", "first place", "second place", "third place"))
TIME = lexicon(("yesterday", "tomorrow", "hour", "hours", "minute", "minutes", "weekday", "weekdays"),
               ("#n1 am", "#n1 pm", "#n2 am", "#n2 pm", "days ago", "day ago", "days later", "weeks ago",
                "weeks later", "months ago", "months later", "years ago", "years later", "years old", "/ #n4",
                ": #n2"))
NUMBER_WORDS = lexicon(("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                        "twelve", "twenty", "hundred", "thousand", "dozen", "half", "twice", "thrice", "quarter"))
CONSTRAINT = lexicon(("must", "exactly", "cannot", "each", "every"),
                     ("at least", "at most", "only one", "all of", "none of", "such that", "so that", "given that",
                      "no more"))
STYLE = lexicon(("sarcastic", "sarcasm", "humorous", "humor", "humour", "funny", "joke", "jokes", "ironic",
                 "irony", "tone", "polite", "formal", "informal", "rewrite", "rephrase", "paraphrase", "poem",
                 "story", "essay", "slogan", "tweet", "email", "letter", "lyrics", "creative", "catchy",
                 "persuasive", "recommend", "recommendation", "recommendations", "favorite", "favourite",
                 "plausible", "typical"),
                ("similar to",))
LANGUAGE = lexicon(("translate", "translation", "translations", "translated", "grammar", "grammatical",
                    "adjective", "adjectives", "adverb", "noun", "nouns", "verb", "verbs", "pronoun", "synonym",
                    "synonyms", "antonym", "antonyms", "spelling", "spell", "spelled", "punctuation", "sentence",
                    "sentences", "idiom", "idioms"),
                   ("word order",))

_ARITH = re.compile(r"-?\d+(?:\.\d+)?\s*[-+*/×÷^%]\s*\(?\s*-?\d")
_RECALL = re.compile(r"^\s*(?:who|when|where|what year|what is the name|which (?:country|city|state|company|"
                     r"person|author|actor|team|river|movie|book|song)|in which|in what year|name the|"
                     r"what does \w+ stand for|what is the capital|what is the meaning of|define)\b")
_OPINION = re.compile(r"\b(?:do you think|what do you|your opinion|would you|should i|is it (?:good|bad|"
                      r"better|worth|ok)|pros and cons|advice|feel about|prefer)\b")
_SENTENCE_END = frozenset(".!?:;\n")


def _paren_depth(toks: list[str]) -> int:
    depth = peak = 0
    for t in toks:
        if t == "(":
            depth += 1
            peak = max(peak, depth)
        elif t == ")":
            depth = max(depth - 1, 0)
    return peak


def _entity_names(raw: list[str]) -> int:
    """Distinct capitalised words that do not start a sentence (people, places, objects by name)."""
    names = set()
    prev = "."
    for t in raw[:400]:
        if len(t) >= 3 and t[0].isupper() and t[1:].islower() and prev not in _SENTENCE_END:
            names.add(t)
        prev = t
    return len(names)


def reasoning_cues(scan: Scan) -> list[float]:
    """Cue values in REASONING_NAMES order for a scanned (capped) last user turn."""
    nw = max(scan.n_words, 1)
    lower = scan.lower
    head = lower[:300]
    n_numbers = len(scan.numbers)
    return [
        math.log1p(scan.count(SEQUENCE)),
        math.log1p(scan.count(STATE_CHANGE)),
        math.log1p(scan.count(COUNT_Q)),
        math.log1p(scan.count(QUANTITY_Q)),
        math.log1p(len(_ARITH.findall(scan.text))) if n_numbers >= 2 else 0.0,
        math.log1p(_paren_depth(scan.toks)) if "(" in scan.text else 0.0,
        math.log1p(scan.count(TRUTH)),
        min(scan.count(CONNECTIVES) / nw * 5.0, 2.0),
        math.log1p(scan.count(ORDERING)),
        math.log1p(scan.count(ORDINALS)),
        math.log1p(scan.count(TIME)),
        math.log1p(_entity_names(scan.raw)),
        math.log1p(scan.count(NUMBER_WORDS)),
        math.log1p(n_numbers) if len(scan.words) >= 15 else 0.0,  # numbers inside a narrative
        math.log1p(scan.count(CONSTRAINT)),
        1.0 if _RECALL.match(head) else 0.0,
        math.log1p(scan.count(STYLE)),
        math.log1p(scan.count(LANGUAGE)),
        1.0 if _OPINION.search(head) else 0.0,
    ]
