"""Outcomes: the unit of learning and of routing evaluation.

Two plain record types:

- ``OutcomeItem``: one prompt with the outcome of one or more *arms* (a tier, model or effort
  level) — full information when every arm of interest has an outcome (an offline
  evaluation, e.g. BIG-Bench-Hard direct vs chain-of-thought), partial otherwise.
- ``OutcomeRecord``: one logged routing decision — the arm that ran, its outcome in [0, 1],
  its cost, the propensity with which the logging policy chose it (1.0 without exploration),
  optional timestamp and tenant. This is what a gateway logs, what the off-policy learner
  (classifier.online) updates on, and what the promotion guard replays.

File formats read by ``load_outcome_items`` (JSONL; CSV for the flat forms):

1. Generic: ``{"prompt" | "messages", "outcomes": {arm: outcome, ...}, "costs": {arm: cost},
   "group", "timestamp", "tenant"}`` — full or partial; any arm names (tiers by default).
2. Logged decisions (also ``load_outcome_records``): ``{"prompt" | "messages" | "features", "arm",
   "outcome", "propensity", "cost", "timestamp", "tenant", "group"}``; one record per line,
   several lines may share a prompt.
3. Two-model files (what ``tiergate classifier eval`` always read): ``cheap`` / ``strong``
   columns (aliases ``cheap_outcome``, ``weak``, ``strong_outcome``) = arms ``low`` / ``high``.
4. A named mapping (``OutcomeMapping``) for a known file: ``BBH_MAPPING`` reads
   ``bbh_direct_vs_cot.jsonl`` — ``input`` is the prompt, ``direct_correct`` the *low* effort arm
   (answer directly), ``cot_correct`` the *high* effort arm (think step by step first), ``task``
   the group. ``KNOWN_MAPPINGS`` are recognised from a file's first row.

Outcomes are booleans (true/false/yes/no/1/0) or scores in [0, 1].

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from classifier.types import ClassifierError, Message, SparseFeatures, user_prompt

_CHEAP = ("cheap", "cheap_outcome", "weak", "weak_outcome")
_STRONG = ("strong", "strong_outcome")
_TRUE = {"true", "yes", "y", "t", "correct"}
_FALSE = {"false", "no", "n", "f", "wrong", "incorrect", ""}
CHEAP_ARM = "low"
STRONG_ARM = "high"


@dataclass(frozen=True)
class OutcomeItem:
    """One prompt and the outcomes (in [0, 1]) of the arms that were run on it."""

    messages: Sequence[Message]
    outcomes: Mapping[str, float]
    costs: Mapping[str, float] = field(default_factory=dict)
    group: str | None = None  # task / source / subject: the unit held out in grouped validation
    timestamp: float | None = None
    tenant: str | None = None

    def has(self, *arms: str) -> bool:
        return all(a in self.outcomes for a in arms)

    def gain(self, cheap: str = CHEAP_ARM, strong: str = STRONG_ARM) -> float:
        """How much the strong arm beat the cheap one (needs both)."""
        return self.outcomes[strong] - self.outcomes[cheap]


@dataclass(frozen=True)
class OutcomeRecord:
    """One logged decision: the arm that ran and what came of it.

    ``propensity`` is the probability with which the logging policy chose ``arm`` for this
    request (1.0 when it was not randomised); off-policy learning and evaluation weight the
    record by its inverse. Either ``messages`` or ``features`` (stored hashed features, when
    the tenant does not allow prompt text) must be present.
    """

    arm: str
    outcome: float
    messages: Sequence[Message] | None = None
    features: SparseFeatures | None = None
    cost: float | None = None
    propensity: float = 1.0
    timestamp: float | None = None
    tenant: str | None = None
    group: str | None = None
    model: str | None = None
    effort: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.outcome <= 1.0:
            raise ClassifierError(f"outcome must be in [0, 1], got {self.outcome}")
        if not 0.0 < self.propensity <= 1.0:
            raise ClassifierError(f"propensity must be in (0, 1], got {self.propensity}")
        if self.messages is None and self.features is None:
            raise ClassifierError("an outcome record needs messages or stored features")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"arm": self.arm, "outcome": self.outcome, "propensity": self.propensity}
        if self.messages is not None:
            out["messages"] = [dict(m) for m in self.messages]
        if self.features is not None:
            out["features"] = self.features.to_json()
        for name in ("cost", "timestamp", "tenant", "group", "model", "effort"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class OutcomeMapping:
    """Where a file keeps the prompt, each arm's outcome, the group and the time."""

    name: str
    prompt: str
    arms: Mapping[str, str]  # arm name → field holding its outcome
    group: str | None = None
    timestamp: str | None = None
    costs: Mapping[str, str] = field(default_factory=dict)

    def matches(self, row: Mapping[str, Any]) -> bool:
        return self.prompt in row and all(f in row for f in self.arms.values())


BBH_MAPPING = OutcomeMapping(name="bbh_direct_vs_cot", prompt="input",
                             arms={CHEAP_ARM: "direct_correct", STRONG_ARM: "cot_correct"}, group="task")
KNOWN_MAPPINGS: tuple[OutcomeMapping, ...] = (BBH_MAPPING,)


@dataclass(frozen=True)
class Outcome:
    """A prompt with a cheap and a strong model's outcome (the two-arm view of an item)."""

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


def _pick(row: Mapping[str, Any], names: tuple[str, ...], where: str) -> Any:
    for n in names:
        if n in row:
            return row[n]
    raise ClassifierError(f"{where}: missing column (one of {', '.join(names)})")


def _messages(row: Mapping[str, Any], where: str, prompt_field: str = "prompt") -> list[Message]:
    if isinstance(row.get("messages"), list):
        return list(row["messages"])
    if prompt_field in row:
        return user_prompt(str(row[prompt_field]))
    raise ClassifierError(f"{where}: needs a '{prompt_field}' or 'messages' field")


def _float_or_none(value: Any) -> float | None:
    return None if value is None or value == "" else float(value)


def _str_or_none(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)


def item_from_row(row: Mapping[str, Any], where: str, mapping: OutcomeMapping | None = None) -> OutcomeItem:
    """One item from a parsed row in any of the formats of the module docstring."""
    if mapping is None:
        mapping = next((m for m in KNOWN_MAPPINGS if m.matches(row)), None)
    if mapping is not None:
        return OutcomeItem(
            _messages(row, where, mapping.prompt),
            {arm: parse_outcome(row[f], where) for arm, f in mapping.arms.items()},
            {arm: float(row[f]) for arm, f in mapping.costs.items() if f in row},
            _str_or_none(row.get(mapping.group)) if mapping.group else None,
            _float_or_none(row.get(mapping.timestamp)) if mapping.timestamp else None)
    group, timestamp, tenant = (_str_or_none(row.get("group")), _float_or_none(row.get("timestamp")),
                                _str_or_none(row.get("tenant")))
    if isinstance(row.get("outcomes"), Mapping):
        outcomes = {str(a): parse_outcome(v, where) for a, v in row["outcomes"].items()}
        costs = {str(a): float(v) for a, v in (row.get("costs") or {}).items()}
        return OutcomeItem(_messages(row, where), outcomes, costs, group, timestamp, tenant)
    if "arm" in row and "outcome" in row:
        costs = {str(row["arm"]): float(row["cost"])} if row.get("cost") not in (None, "") else {}
        return OutcomeItem(_messages(row, where), {str(row["arm"]): parse_outcome(row["outcome"], where)},
                           costs, group, timestamp, tenant)
    return OutcomeItem(_messages(row, where), {CHEAP_ARM: parse_outcome(_pick(row, _CHEAP, where), where),
                                               STRONG_ARM: parse_outcome(_pick(row, _STRONG, where), where)},
                       {}, group, timestamp, tenant)


def _rows(path: Path) -> Iterable[tuple[dict[str, Any], str]]:
    if not path.exists():
        raise ClassifierError(f"outcomes file {path} does not exist")
    with path.open(encoding="utf-8", newline="") as fh:
        if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ClassifierError(f"{path}:{n}: not valid JSON: {err}") from None
                    if not isinstance(row, dict):
                        raise ClassifierError(f"{path}:{n}: each line must be a JSON object")
                    yield row, f"{path}:{n}"
        else:
            for n, row in enumerate(csv.DictReader(fh), 2):
                yield dict(row), f"{path}:{n}"


def load_outcome_items(path: str | Path, mapping: OutcomeMapping | None = None) -> list[OutcomeItem]:
    """Every item of an outcomes file (see the module docstring for the formats)."""
    out = [item_from_row(row, where, mapping) for row, where in _rows(Path(path))]
    if not out:
        raise ClassifierError(f"outcomes file {path} holds no rows")
    return out


def record_from_row(row: Mapping[str, Any], where: str) -> OutcomeRecord:
    if "arm" not in row or "outcome" not in row:
        raise ClassifierError(f"{where}: a logged record needs 'arm' and 'outcome'")
    features = SparseFeatures.from_json(row["features"]) if isinstance(row.get("features"), Mapping) else None
    messages = None if features is not None and "messages" not in row and "prompt" not in row else \
        _messages(row, where)
    try:
        return OutcomeRecord(arm=str(row["arm"]), outcome=parse_outcome(row["outcome"], where), messages=messages,
                             features=features, cost=_float_or_none(row.get("cost")),
                             propensity=float(row.get("propensity", 1.0)),
                             timestamp=_float_or_none(row.get("timestamp")), tenant=_str_or_none(row.get("tenant")),
                             group=_str_or_none(row.get("group")), model=_str_or_none(row.get("model")),
                             effort=_str_or_none(row.get("effort")))
    except ClassifierError as err:
        raise ClassifierError(f"{where}: {err}") from None


def load_outcome_records(path: str | Path) -> list[OutcomeRecord]:
    """Logged decisions (format 2 of the module docstring), one per line."""
    out = [record_from_row(row, where) for row, where in _rows(Path(path))]
    if not out:
        raise ClassifierError(f"outcomes file {path} holds no rows")
    return out


def save_outcome_records(records: Iterable[OutcomeRecord], path: str | Path) -> int:
    """Write records as JSONL (the format ``load_outcome_records`` reads); returns how many."""
    n = 0
    with Path(path).open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
            n += 1
    return n


def items_to_records(items: Iterable[OutcomeItem]) -> list[OutcomeRecord]:
    """Every (item, arm) outcome as a record with propensity 1 (full-information data)."""
    return [OutcomeRecord(arm=arm, outcome=v, messages=it.messages, cost=it.costs.get(arm), timestamp=it.timestamp,
                          tenant=it.tenant, group=it.group)
            for it in items for arm, v in it.outcomes.items()]


def outcome_set_hash(items: Iterable[OutcomeItem]) -> str:
    """A stable sha256 of an outcome set (prompts, outcomes, groups): tells whether an artifact was
    trained on the file being evaluated."""
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([[dict(m) for m in it.messages], sorted(it.outcomes.items()), it.group],
                            sort_keys=True, ensure_ascii=False, default=str).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def two_arm(items: Sequence[OutcomeItem], cheap: str = CHEAP_ARM, strong: str = STRONG_ARM) -> list[Outcome]:
    """The items that have both arms, as cheap/strong outcomes."""
    return [Outcome(list(it.messages), it.outcomes[cheap], it.outcomes[strong]) for it in items
            if it.has(cheap, strong)]


def load_outcomes(path: str | Path, mapping: OutcomeMapping | None = None, *, cheap: str = CHEAP_ARM,
                  strong: str = STRONG_ARM) -> list[Outcome]:
    """Cheap/strong outcomes of every prompt of a file that has both arms."""
    items = load_outcome_items(path, mapping)
    out = two_arm(items, cheap, strong)
    if not out:
        raise ClassifierError(f"outcomes file {path} has no prompt with both the {cheap!r} and {strong!r} arm")
    return out
