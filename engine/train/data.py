"""Training corpus for the bundled demo models, built from the shared datasets.

Every record of the shared data folder (see its MANIFEST.md) becomes one *document*: a
question → worked-answer chat in Qwen-style ChatML, or a passage of the Shakespeare
corpus as plain text. Documents are split into train / validation by record with a fixed
seed, so `tiergate engine train` re-creates the same split on any machine.

Only training splits are used; evaluation sets (GSM8K test, HumanEval, the Qwen math
evaluation sets, ARC Dev/Test, NQ test) are deliberately left out so that other parts
of tiergate can still evaluate on them.

This module is plain Python (json, random, re): it must not import torch, the gateway,
the classifier or any web/db library.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYSTEM_PROMPT = "You are a helpful assistant."
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)

# Long fields are trimmed so that no single source dominates the corpus and most chats
# fit the demo model's context window.
MAX_QUESTION_CHARS = 1200
MAX_ANSWER_CHARS = 1500

_CALCULATOR = re.compile(r"<<[^>]*>>")


@dataclass(frozen=True)
class Document:
    """One training record rendered as text, with the source it came from."""

    source: str
    text: str


@dataclass(frozen=True)
class CorpusSplit:
    train: list[Document]
    validation: list[Document]

    def sources(self) -> dict[str, tuple[int, int]]:
        """Per source: (train records, validation records)."""
        out: dict[str, tuple[int, int]] = {}
        for doc in self.train:
            t, v = out.get(doc.source, (0, 0))
            out[doc.source] = (t + 1, v)
        for doc in self.validation:
            t, v = out.get(doc.source, (0, 0))
            out[doc.source] = (t, v + 1)
        return dict(sorted(out.items()))


def chat_text(question: str, answer: str, system: str = SYSTEM_PROMPT) -> str:
    """Render one exchange exactly as the shipped chat template renders it, plus the answer."""
    return (
        f"{IM_START}system\n{system}{IM_END}\n"
        f"{IM_START}user\n{question.strip()}{IM_END}\n"
        f"{IM_START}assistant\n{answer.strip()}{IM_END}\n"
    )


def _trim(text: str, limit: int) -> str:
    text = text.replace("\r\n", "\n").strip()
    if len(text) <= limit:
        return text
    cut = text[:limit]
    nl = cut.rfind("\n")
    return cut[:nl] if nl > limit // 2 else cut


def _chat(source: str, question: str, answer: str) -> Document:
    return Document(source, chat_text(_trim(question, MAX_QUESTION_CHARS), _trim(answer, MAX_ANSWER_CHARS)))


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


# --- one formatter per source -------------------------------------------------------------

def gsm8k_documents(records: Iterable[dict[str, Any]]) -> Iterator[Document]:
    for r in records:
        body, _, final = r["answer"].rpartition("####")
        answer = _CALCULATOR.sub("", body).strip() + f"\nThe answer is {final.strip()}."
        yield _chat("gsm8k", r["question"], answer)


def math_documents(records: Iterable[dict[str, Any]]) -> Iterator[Document]:
    for r in records:
        yield _chat("math", r["problem"], r["solution"])


def mbpp_documents(records: Iterable[dict[str, Any]]) -> Iterator[Document]:
    for r in records:
        tests = r.get("test_list") or []
        question = r["text"] + (f" Your code should pass this test:\n{tests[0]}" if tests else "")
        code = r["code"].replace("\r\n", "\n").replace("\t", "    ")
        yield _chat("mbpp", question, f"```python\n{code.strip()}\n```")


def self_instruct_documents(records: Iterable[dict[str, Any]]) -> Iterator[Document]:
    for r in records:
        for inst in r.get("instances", []):
            question = r["instruction"] + (f"\n\n{inst['input']}" if inst.get("input") else "")
            if inst.get("output"):
                yield _chat("self_instruct", question, inst["output"])


def nq_documents(records: Iterable[dict[str, Any]]) -> Iterator[Document]:
    for r in records:
        q = r["question"].strip()
        question = q[0].upper() + q[1:] + ("" if q.endswith("?") else "?")
        yield _chat("nq_open", question, r["answer"][0] + ".")


def arc_documents(records: Iterable[dict[str, Any]]) -> Iterator[Document]:
    for r in records:
        choices = {c["label"]: c["text"] for c in r["question"]["choices"]}
        key = r["answerKey"]
        if key not in choices:
            continue
        options = "\n".join(f"{label}. {text}" for label, text in choices.items())
        question = f"{r['question']['stem']}\n{options}"
        yield _chat("arc", question, f"The answer is {key}. {choices[key]}")


def leetcode_documents(records: Iterable[dict[str, Any]]) -> Iterator[Document]:
    for r in records:
        problem = r["problem"].replace("\u00a0", " ")
        problem = problem.split("Please complete the following python code precisely:")[0]
        yield _chat("leetcode", problem, f"```python\n{r['solution'].strip()}\n```")


def shakespeare_documents(text: str, passage_lines: int = 24) -> Iterator[Document]:
    """Consecutive speeches grouped into passages of about `passage_lines` lines."""
    speeches = [s.strip() for s in text.replace("\r\n", "\n").split("\n\n") if s.strip()]
    passage: list[str] = []
    n_lines = 0
    for speech in speeches:
        passage.append(speech)
        n_lines += speech.count("\n") + 1
        if n_lines >= passage_lines:
            yield Document("shakespeare", "\n\n".join(passage) + "\n" + END_OF_TEXT)
            passage, n_lines = [], 0
    if passage:
        yield Document("shakespeare", "\n\n".join(passage) + "\n" + END_OF_TEXT)


def load_documents(data_dir: str | Path) -> list[Document]:
    """Every training document, in a fixed order, from the shared data folder."""
    d = Path(data_dir)
    if not (d / "MANIFEST.md").is_file():
        raise FileNotFoundError(f"{d} is not the shared data folder (no MANIFEST.md)")
    docs: list[Document] = []
    docs += gsm8k_documents(_jsonl(d / "gsm8k" / "train.jsonl"))
    docs += math_documents(_jsonl(d / "math" / "MATH_test_5000.jsonl"))
    docs += mbpp_documents(_jsonl(d / "mbpp" / "mbpp.jsonl"))
    for name in ("seed_tasks.jsonl", "user_oriented_instructions.jsonl"):
        docs += self_instruct_documents(_jsonl(d / "self_instruct" / name))
    for name in ("NQ-open.dev.jsonl", "NQ-open.efficientqa.dev.1.1.jsonl"):
        docs += nq_documents(_jsonl(d / "nq_open" / name))
    for name in ("ARC-Easy-Train.jsonl", "ARC-Challenge-Train.jsonl"):
        docs += arc_documents(_jsonl(d / "arc" / name))
    docs += leetcode_documents(_jsonl(d / "leetcode" / "leetcode_train.jsonl"))
    docs += shakespeare_documents((d / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8"))
    return docs


def split_documents(docs: list[Document], validation_fraction: float = 0.02, seed: int = 1234) -> CorpusSplit:
    """Deterministic split by record: shuffle indices with `seed`, hold out a fraction of each source."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError("validation_fraction must be in [0, 1)")
    rng = random.Random(seed)
    by_source: dict[str, list[Document]] = {}
    for doc in docs:
        by_source.setdefault(doc.source, []).append(doc)
    train: list[Document] = []
    validation: list[Document] = []
    for source in sorted(by_source):
        group = by_source[source]
        order = list(range(len(group)))
        rng.shuffle(order)
        n_val = round(len(group) * validation_fraction)
        validation += [group[i] for i in sorted(order[:n_val])]
        train += [group[i] for i in sorted(order[n_val:])]
    rng.shuffle(train)
    return CorpusSplit(train=train, validation=validation)


def build_corpus(data_dir: str | Path, validation_fraction: float = 0.02, seed: int = 1234) -> CorpusSplit:
    return split_documents(load_documents(data_dir), validation_fraction, seed)
