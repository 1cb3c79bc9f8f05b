"""Builds the labelled training set from the shared data folder (see classifier/LABELS.md).

Each source's difficulty signal (MATH level, ARC split, LeetCode difficulty, GSM8K
solution length, the source itself) maps onto a tier and a continuous score in [0, 1].
Prompts are de-duplicated on normalised text; every example keeps its source so that
splits can be grouped by source. GSM-Hard is never read: it is GSM8K *test* with bigger
numbers, and GSM8K-like prompts are among the held-out evaluation kinds.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from classifier.augment import augment
from classifier.types import ClassifierError, LabelledExample, user_prompt

Record = dict[str, Any]
Builder = Callable[[Path], Iterator[tuple[str, str, float, str]]]  # (source, tier, score, text)
EXCLUDED_SOURCES = ("qwen_math_eval/gsm_hard.jsonl",)


def _jsonl(path: Path) -> Iterator[Record]:
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def _choices_text(stem: str, choices: list[tuple[str, str]]) -> str:
    return stem.strip() + "\n" + "\n".join(f"{label}. {text}" for label, text in choices)


def _nq(root: Path) -> Iterator[tuple[str, str, float, str]]:
    for name in ("NQ-open.dev.jsonl", "NQ-open.efficientqa.dev.1.1.jsonl", "NQ-open.efficientqa.test.1.1.jsonl"):
        for r in _jsonl(root / "nq_open" / name):
            q = r["question"].strip()
            yield "nq_open", "none", 0.05, (q[0].upper() + q[1:] + "?") if q else q


def _self_instruct(root: Path) -> Iterator[tuple[str, str, float, str]]:
    for name in ("seed_tasks.jsonl", "user_oriented_instructions.jsonl"):
        for r in _jsonl(root / "self_instruct" / name):
            inst = (r.get("instances") or [{}])[0].get("input", "") or ""
            text = r["instruction"].strip() + (("\n\n" + inst.strip()) if inst.strip() else "")
            yield "self_instruct", "minimal", 0.15 if not inst.strip() else 0.2, text


def _easy_arith(root: Path) -> Iterator[tuple[str, str, float, str]]:
    for r in _jsonl(root / "qwen_math_eval" / "mawps.jsonl"):
        yield "mawps", "low", 0.2, r["input"]
    for r in _jsonl(root / "qwen_math_eval" / "asdiv.jsonl"):
        yield "asdiv", "low", 0.2, f"{r['body'].strip()} {r['question'].strip()}"
    for r in _jsonl(root / "qwen_math_eval" / "svamp.jsonl"):
        yield "svamp", "low", 0.25, f"{r['Body'].strip()} {r['Question'].strip()}"


def _arc(root: Path) -> Iterator[tuple[str, str, float, str]]:
    for level, tier, score in (("Easy", "low", 0.28), ("Challenge", "medium", 0.45)):
        for split in ("Train", "Dev", "Test"):
            for r in _jsonl(root / "arc" / f"ARC-{level}-{split}.jsonl"):
                q = r["question"]
                text = _choices_text(q["stem"], [(c["label"], c["text"]) for c in q["choices"]])
                yield f"arc_{level.lower()}", tier, score, text


def _gsm8k(root: Path) -> Iterator[tuple[str, str, float, str]]:
    for r in _jsonl(root / "gsm8k" / "train.jsonl"):
        steps = sum(1 for ln in r["answer"].splitlines() if ln.strip() and not ln.startswith("####"))
        tier = "low" if steps <= 3 else ("medium" if steps <= 6 else "high")
        yield "gsm8k", tier, min(0.25 + 0.05 * steps, 0.65), r["question"]


def _math(root: Path) -> Iterator[tuple[str, str, float, str]]:
    for r in _jsonl(root / "math" / "MATH_test_5000.jsonl"):
        m = re.search(r"(\d)", r.get("level", ""))
        level = int(m.group(1)) if m else 3
        tier = "low" if level == 1 else ("medium" if level <= 3 else "high")
        yield "math", tier, 0.35 + 0.1 * (level - 1), r["problem"]


def _mid_math(root: Path) -> Iterator[tuple[str, str, float, str]]:
    for r in _jsonl(root / "qwen_math_eval" / "aqua.jsonl"):
        yield "aqua", "medium", 0.5, r["question"].strip() + "\n" + "\n".join(r["options"])
    for r in _jsonl(root / "qwen_math_eval" / "sat_math.jsonl"):
        yield "sat_math", "medium", 0.45, r["question"].strip() + "\n" + r["options"]
    for r in _jsonl(root / "qwen_math_eval" / "carp_en.jsonl"):
        yield "carp_en", "medium", 0.45, r["content"]


def _hard_math(root: Path) -> Iterator[tuple[str, str, float, str]]:
    for r in _jsonl(root / "qwen_math_eval" / "college_math.jsonl"):
        topic = str(r.get("data_topic", ""))
        easy = "algebra" in topic or "precalculus" in topic
        yield "college_math", "medium" if easy else "high", 0.5 if easy else 0.62, r["question"]
    for r in _jsonl(root / "qwen_math_eval" / "gaokao2023en.jsonl"):
        yield "gaokao2023en", "high", 0.65, r["question"]
    for r in _jsonl(root / "qwen_math_eval" / "minerva_math.jsonl"):
        yield "minerva_math", "high", 0.72, r["problem"]
    for r in _jsonl(root / "qwen_math_eval" / "olympiadbench.jsonl"):
        yield "olympiadbench", "xhigh", 0.88, r["question"]
    for r in _jsonl(root / "qwen_math_eval" / "amc23.jsonl"):
        yield "amc23", "xhigh", 0.9, r.get("problem") or r["question"]
    for r in _jsonl(root / "qwen_math_eval" / "aime24.jsonl"):
        yield "aime24", "xhigh", 0.97, r.get("problem") or r["question"]


def _code(root: Path) -> Iterator[tuple[str, str, float, str]]:
    for r in _jsonl(root / "mbpp" / "mbpp.jsonl"):
        tests = "\n".join(r.get("test_list", [])[:1])
        yield "mbpp", "low", 0.32, r["text"].strip() + ("\nYour code should pass this test:\n" + tests if tests else "")
    for r in _jsonl(root / "humaneval" / "HumanEval.jsonl"):
        yield "humaneval", "medium", 0.45, r["prompt"]
    diff = {"Easy": ("low", 0.4), "Medium": ("medium", 0.58), "Hard": ("high", 0.8)}
    for name in ("leetcode_train.jsonl", "leetcode_test.jsonl"):
        for r in _jsonl(root / "leetcode" / name):
            tier, score = diff.get(r.get("difficulty", "Medium"), ("medium", 0.58))
            yield "leetcode", tier, score, r["problem"]


BUILDERS: tuple[Builder, ...] = (_nq, _self_instruct, _easy_arith, _arc, _gsm8k, _math, _mid_math,
                                  _hard_math, _code)


def normalise(text: str) -> str:
    """The de-duplication key: lower-case, whitespace collapsed."""
    return " ".join(text.lower().split())


def build_dataset(data_dir: str | Path, *, augmented: bool = True) -> list[LabelledExample]:
    """Every labelled example from ``data_dir`` (the shared data folder), de-duplicated; with
    ``augmented``, followed by the system-prompt / multi-turn variants of classifier.augment."""
    root = Path(data_dir)
    if not (root / "MANIFEST.md").exists():
        raise ClassifierError(f"{root} does not look like the shared data folder (no MANIFEST.md)")
    seen: set[str] = set()
    out: list[LabelledExample] = []
    for builder in BUILDERS:
        for source, tier, score, text in builder(root):
            key = normalise(text)
            if not key or key in seen:
                continue
            seen.add(key)
            out.append(LabelledExample(tier=tier, score=round(score, 4), source=source,
                                       messages=user_prompt(text.strip())))
    return out + augment(out) if augmented else out


def dataset_hash(examples: list[LabelledExample]) -> str:
    """A stable sha256 over the labelled examples (text or stored features, label, source, weight)."""
    h = hashlib.sha256()
    for ex in examples:
        body: Any = ex.features.to_json() if ex.features is not None else list(ex.messages or [])
        h.update(json.dumps([ex.source, ex.tier, ex.score, ex.weight, body], sort_keys=True,
                            ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()
