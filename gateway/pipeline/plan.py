"""The plan stage's data and text: a JSON-schema'd plan of steps, the prompts that ask the high
tier for one (and repair a bad one), and a tolerant parser (JSON object or array, fenced or
not, or a numbered/bulleted list when no JSON is present, or in the repair round plain lines)
plus validation (ids, dependencies, no cycles, step limit).

Pure: no model calls (the runner calls the model through ``StageCaller``). Imports nothing
from the gateway.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

# The plan's JSON schema (what the planner's example shows; usable as a ``response_format``).
PLAN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["steps"],
    "properties": {"steps": {"type": "array", "minItems": 1, "items": {
        "type": "object",
        "required": ["id", "instruction", "expected_output", "depends_on"],
        "properties": {
            "id": {"type": "string"},
            "instruction": {"type": "string"},
            "expected_output": {"type": "string"},
            "depends_on": {"type": "array", "items": {"type": "string"}},
        }}}},
}

PlanSource = Literal["json", "list", "lines", "single_step"]
MIN_LINE_STEPS = 2  # a plain-lines plan (repair round only) needs at least this many lines
_LIST_ITEM = re.compile(r"^\s*(?:(?:step\s*)?\d+\s*[.):]|[-*•])\s+(.+?)\s*$", re.IGNORECASE)
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


class PlanInvalid(ValueError):
    """The plan text could not be parsed or does not satisfy the schema."""


@dataclass(frozen=True)
class PlanStep:
    id: str
    instruction: str
    expected_output: str = ""
    depends_on: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    steps: tuple[PlanStep, ...]
    source: PlanSource = "json"

    def step(self, step_id: str) -> PlanStep:
        return next(s for s in self.steps if s.id == step_id)

    def dependants(self, step_ids: set[str]) -> set[str]:
        """``step_ids`` plus every step that transitively depends on them."""
        out = set(step_ids)
        changed = True
        while changed:
            changed = False
            for s in self.steps:
                if s.id not in out and out.intersection(s.depends_on):
                    out.add(s.id)
                    changed = True
        return out

    def sinks(self) -> list[PlanStep]:
        """Steps nothing depends on: their outputs are the plan's results."""
        used = {d for s in self.steps for d in s.depends_on}
        return [s for s in self.steps if s.id not in used]

    def to_dict(self) -> dict[str, Any]:
        return {"steps": [{"id": s.id, "instruction": s.instruction, "expected_output": s.expected_output,
                           "depends_on": list(s.depends_on)} for s in self.steps]}


PLAN_SYSTEM = (
    "You are the planner. Split the user's request into at most {max_steps} short steps a smaller "
    "model can do one at a time; steps that do not need each other's results have no dependencies. "
    'Reply with JSON only, like {{"steps": [{{"id": "s1", "instruction": "...", "expected_output": '
    '"...", "depends_on": []}}, {{"id": "s2", "instruction": "...", "expected_output": "...", '
    '"depends_on": ["s1"]}}]}}'
)


def plan_messages(messages: list[dict[str, Any]], max_steps: int) -> list[dict[str, Any]]:
    system = PLAN_SYSTEM.format(max_steps=max_steps)
    return [{"role": "system", "content": system}, *messages]


def repair_messages(messages: list[dict[str, Any]], bad_reply: str, error: str,
                    max_steps: int) -> list[dict[str, Any]]:
    return [*plan_messages(messages, max_steps), {"role": "assistant", "content": bad_reply},
            {"role": "user", "content": f"That plan is invalid: {error}. Reply again with JSON only "
                                        "matching the schema, or failing that a numbered list of steps, "
                                        "one step per line."}]


def _json_candidates(text: str) -> list[str]:
    out = [m.strip() for m in _FENCE.findall(text)]
    for open_ch, close_ch in (("{", "}"), ("[", "]")):
        start, end = text.find(open_ch), text.rfind(close_ch)
        if start != -1 and end > start:
            out.append(text[start:end + 1])
    return out


def _from_json(data: Any, max_steps: int) -> Plan:
    raw_steps = data.get("steps") if isinstance(data, dict) else data
    if not isinstance(raw_steps, list) or not raw_steps:
        raise PlanInvalid("'steps' must be a non-empty array")
    steps = []
    for i, raw in enumerate(raw_steps, start=1):
        if not isinstance(raw, dict):
            raise PlanInvalid(f"step {i} is not an object")
        instruction = raw.get("instruction")
        if not isinstance(instruction, str) or not instruction.strip():
            raise PlanInvalid(f"step {i} has no instruction")
        deps = raw.get("depends_on") or []
        if isinstance(deps, str):
            deps = [deps]
        if not isinstance(deps, list) or not all(isinstance(d, str | int) for d in deps):
            raise PlanInvalid(f"step {i}: depends_on must be an array of step ids")
        steps.append(PlanStep(id=str(raw.get("id") or f"s{i}"), instruction=instruction.strip(),
                              expected_output=str(raw.get("expected_output") or ""),
                              depends_on=tuple(str(d) for d in deps)))
    return validate_plan(Plan(tuple(steps), "json"), max_steps)


def _chain(items: list[str], max_steps: int, source: PlanSource) -> Plan:
    steps = tuple(PlanStep(id=f"s{i}", instruction=item, depends_on=(f"s{i - 1}",) if i > 1 else ())
                  for i, item in enumerate(items[:max_steps], start=1))
    return Plan(steps, source)


def _from_list(text: str, max_steps: int, allow_lines: bool) -> Plan:
    items = [m.group(1) for line in text.splitlines() if (m := _LIST_ITEM.match(line))]
    items = [i for i in items if len(i) >= 3]
    if items:
        return _chain(items, max_steps, "list")
    if allow_lines:
        lines = [ln.strip() for ln in text.splitlines() if sum(ch.isalpha() for ch in ln) >= 3]
        if len(lines) >= MIN_LINE_STEPS:
            return _chain(lines, max_steps, "lines")
    raise PlanInvalid("no JSON object and no numbered list found")


def parse_plan(text: str, max_steps: int, *, allow_lines: bool = False) -> Plan:
    """JSON first (fenced or bare, object or array); else a numbered/bulleted list (each item
    depending on the one before); with ``allow_lines`` (the repair round, which asks for one step
    per line) at least two plain lines of text. Raises ``PlanInvalid`` with a message fit for a
    repair prompt."""
    json_error: PlanInvalid | None = None
    for candidate in _json_candidates(text):
        try:
            data = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        try:
            return _from_json(data, max_steps)
        except PlanInvalid as err:
            json_error = err
    if json_error is not None:
        raise json_error
    return _from_list(text, max_steps, allow_lines)


def single_step_plan() -> Plan:
    """The whole request as one step (``pipeline.plan_fallback: single_step``)."""
    return Plan((PlanStep("s1", "Answer the request.", "a complete answer to the request"),), "single_step")


def validate_plan(plan: Plan, max_steps: int) -> Plan:
    ids = [s.id for s in plan.steps]
    if len(ids) > max_steps:
        raise PlanInvalid(f"{len(ids)} steps; at most {max_steps} allowed")
    if len(set(ids)) != len(ids):
        raise PlanInvalid("step ids must be unique")
    known = set(ids)
    for s in plan.steps:
        unknown = [d for d in s.depends_on if d not in known]
        if unknown:
            raise PlanInvalid(f"step {s.id} depends on unknown step(s) {', '.join(unknown)}")
        if s.id in s.depends_on:
            raise PlanInvalid(f"step {s.id} depends on itself")
    layers(plan)  # raises on cycles
    return plan


def layers(plan: Plan) -> list[list[PlanStep]]:
    """Steps grouped so that each group depends only on earlier groups (raises on a cycle)."""
    done: set[str] = set()
    remaining = list(plan.steps)
    out: list[list[PlanStep]] = []
    while remaining:
        ready = [s for s in remaining if set(s.depends_on) <= done]
        if not ready:
            raise PlanInvalid("the steps' dependencies form a cycle: "
                              + ", ".join(s.id for s in remaining))
        out.append(ready)
        done.update(s.id for s in ready)
        remaining = [s for s in remaining if s.id not in done]
    return out
