"""The mixed workload for ``tiergate bench pipeline``: prompts drawn from the read-only shared data
folder, in a given easy/medium/hard mix, each with the difficulty its source signals
(ARC Easy vs Challenge, MATH level, LeetCode difficulty, the dataset itself).

Reads ../shared/data at run time and copies nothing into the repo. Imports no gateway module.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIFFICULTIES = ("easy", "medium", "hard")


@dataclass(frozen=True)
class WorkItem:
    source: str
    difficulty: str  # easy | medium | hard (from the source's own signal)
    signal_tier: str  # the tier that signal maps to (used only when no classifier is available)
    prompt: str


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def _arc(path: Path) -> Iterator[str]:
    for r in _jsonl(path):
        q = r["question"]
        yield q["stem"] + "\n" + "\n".join(f"{c['label']}. {c['text']}" for c in q["choices"])


def _math(root: Path, levels: tuple[str, ...]) -> Iterator[str]:
    return (r["problem"] for r in _jsonl(root / "math/MATH_test_5000.jsonl") if r.get("level") in levels)


def _leetcode(root: Path, difficulty: str) -> Iterator[str]:
    return (r["problem"] for r in _jsonl(root / "leetcode/leetcode_train.jsonl") if r["difficulty"] == difficulty)


def _field(path: Path, *keys: str) -> Iterator[str]:
    for r in _jsonl(path):
        for k in keys:
            if r.get(k):
                yield str(r[k])
                break


# (source, difficulty, signal tier, loader)
SOURCES: tuple[tuple[str, str, str, Callable[[Path], Iterator[str]]], ...] = (
    ("nq_open", "easy", "none", lambda d: (r["question"] + "?" for r in _jsonl(d / "nq_open/NQ-open.dev.jsonl"))),
    ("self_instruct", "easy", "minimal", lambda d: _field(d / "self_instruct/user_oriented_instructions.jsonl",
                                                          "instruction")),
    ("svamp", "easy", "low", lambda d: (f"{r['Body']} {r['Question']}" for r in _jsonl(d / "qwen_math_eval/svamp.jsonl"))),
    ("arc_easy", "easy", "low", lambda d: _arc(d / "arc/ARC-Easy-Train.jsonl")),
    ("gsm8k", "medium", "medium", lambda d: _field(d / "gsm8k/train.jsonl", "question")),
    ("arc_challenge", "medium", "medium", lambda d: _arc(d / "arc/ARC-Challenge-Train.jsonl")),
    ("math_l1_2", "medium", "medium", lambda d: _math(d, ("Level 1", "Level 2"))),
    ("leetcode_easy", "medium", "medium", lambda d: _leetcode(d, "Easy")),
    ("math_l4_5", "hard", "high", lambda d: _math(d, ("Level 4", "Level 5"))),
    ("leetcode_hard", "hard", "high", lambda d: _leetcode(d, "Hard")),
    ("olympiadbench", "hard", "xhigh", lambda d: _field(d / "qwen_math_eval/olympiadbench.jsonl", "question")),
)


def load_pools(data_dir: Path) -> dict[str, list[list[WorkItem]]]:
    """Per difficulty, one list of prompts per source."""
    pools: dict[str, list[list[WorkItem]]] = {d: [] for d in DIFFICULTIES}
    for source, difficulty, tier, loader in SOURCES:
        try:
            items = [WorkItem(source, difficulty, tier, text.strip()) for text in loader(data_dir) if text.strip()]
        except FileNotFoundError:
            continue  # a partial data folder: the sources present still make a workload
        if items:
            pools[difficulty].append(items)
    return pools


def sample_workload(data_dir: Path, n: int, mix: tuple[float, float, float], seed: int) -> list[WorkItem]:
    """``n`` prompts, ``mix`` shares of easy/medium/hard (rounded), shuffled with ``seed``; within a
    difficulty each prompt comes from a source chosen uniformly, so big datasets do not dominate."""
    pools = load_pools(data_dir)
    rng = random.Random(seed)
    counts = [round(n * share / sum(mix)) for share in mix]
    counts[0] += n - sum(counts)
    items: list[WorkItem] = []
    for difficulty, count in zip(DIFFICULTIES, counts, strict=True):
        if count and not pools[difficulty]:
            raise FileNotFoundError(f"no {difficulty} prompts found under {data_dir}")
        items.extend(rng.choice(rng.choice(pools[difficulty])) for _ in range(count))
    rng.shuffle(items)
    return items
