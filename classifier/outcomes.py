"""Reading routing-outcome files for `tiergate classifier eval`.

A file lists prompts with the outcome of a cheap and of a strong model on each:
CSV with a header, or JSONL. The prompt is ``prompt`` (text) or ``messages`` (JSONL, an
OpenAI message list); outcomes are ``cheap``/``strong`` (aliases ``cheap_outcome``,
``strong_outcome``, ``weak``), booleans (true/false/yes/no/1/0) or scores in [0, 1].

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from classifier.types import ClassifierError, Message, user_prompt

_CHEAP = ("cheap", "cheap_outcome", "weak", "weak_outcome")
_STRONG = ("strong", "strong_outcome")
_TRUE = {"true", "yes", "y", "t", "correct"}
_FALSE = {"false", "no", "n", "f", "wrong", "incorrect", ""}


@dataclass(frozen=True)
class Outcome:
    messages: list[Message]
    cheap: float
    strong: float


def parse_outcome(value: Any, where: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        x = float(value)
    else:
        text = str(value).strip().lower()
        if text in _TRUE:
            return 1.0
        if text in _FALSE:
            return 0.0
        try:
            x = float(text)
        except ValueError:
            raise ClassifierError(f"{where}: outcome {value!r} is neither a boolean nor a number") from None
    if not 0.0 <= x <= 1.0:
        raise ClassifierError(f"{where}: outcome {x} is outside [0, 1]")
    return x


def _pick(row: dict[str, Any], names: tuple[str, ...], where: str) -> Any:
    for n in names:
        if n in row:
            return row[n]
    raise ClassifierError(f"{where}: missing column (one of {', '.join(names)})")


def _outcome(row: dict[str, Any], where: str) -> Outcome:
    messages: list[Message]
    if isinstance(row.get("messages"), list):
        messages = list(row["messages"])
    elif "prompt" in row:
        messages = user_prompt(str(row["prompt"]))
    else:
        raise ClassifierError(f"{where}: needs a 'prompt' or 'messages' field")
    return Outcome(messages, parse_outcome(_pick(row, _CHEAP, where), where),
                   parse_outcome(_pick(row, _STRONG, where), where))


def load_outcomes(path: str | Path) -> list[Outcome]:
    path = Path(path)
    if not path.exists():
        raise ClassifierError(f"outcomes file {path} does not exist")
    out: list[Outcome] = []
    with path.open(encoding="utf-8", newline="") as fh:
        if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ClassifierError(f"{path}:{n}: not valid JSON: {err}") from None
                    out.append(_outcome(row, f"{path}:{n}"))
        else:
            for n, row in enumerate(csv.DictReader(fh), 2):
                out.append(_outcome(dict(row), f"{path}:{n}"))
    if not out:
        raise ClassifierError(f"outcomes file {path} holds no rows")
    return out
