"""The review stage's text: the prompt that asks the high tier to check step outputs against the
request and the plan and compose the final answer, and a tolerant parser of its reply.

Reply format asked for (JSON with the same keys is accepted too)::

    VERDICT: accept            (or: VERDICT: revise)
    FAILING: s2, s3            (only with revise)
    ANSWER:
    <the final answer for the user>

A reply without a recognisable verdict is taken as an accepted final answer (``parsed=False``).
Pure: no model calls. Imports pipeline plan/execute only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from gateway.pipeline.plan import Plan

VERBOSITY_HINT = {"low": "Answer in a few sentences at most.", "medium": "Answer concisely.",
                  "high": "Answer thoroughly."}

REVIEW_SYSTEM = (
    "You are the reviewer. Check each step result against the request and the plan. Then reply "
    "in exactly this format:\nVERDICT: accept or revise\nFAILING: comma-separated ids of wrong "
    "steps (only if revise)\nANSWER:\nthe final answer to the user's request, composed from the "
    "correct step results. {verbosity}"
)

_VERDICT = re.compile(r"^\s*\**\s*verdict\s*\**\s*[:=-]\s*\**\s*(accept|revise)", re.IGNORECASE | re.MULTILINE)
_FAILING = re.compile(r"^\s*\**\s*failing(?:[ _]steps)?\s*\**\s*[:=-]\s*(.*)$", re.IGNORECASE | re.MULTILINE)
_ANSWER = re.compile(r"^\s*\**\s*answer\s*\**\s*[:=-]\s*", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class Review:
    verdict: Literal["accept", "revise"]
    failing_steps: tuple[str, ...]
    answer: str
    parsed: bool = True


def review_messages(request: str, plan: Plan, outputs: dict[str, str], verbosity: str | None,
                    alternatives: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
    lines = [f"Request:\n{request}", "Plan and step results:"]
    for s in plan.steps:
        lines.append(f"[{s.id}] {s.instruction}\nExpected: {s.expected_output or '-'}\n"
                     f"Result: {outputs.get(s.id, '(not run)')}")
        for alt in (alternatives or {}).get(s.id, []):
            lines.append(f"[{s.id}] other surviving path: {alt}")
    system = REVIEW_SYSTEM.format(verbosity=VERBOSITY_HINT.get(verbosity or "", ""))
    return [{"role": "system", "content": system.strip()}, {"role": "user", "content": "\n\n".join(lines)}]


def _ids(raw: str, plan: Plan) -> tuple[str, ...]:
    known = {s.id for s in plan.steps}
    found = [t for t in re.split(r"[\s,;\[\]\"']+", raw) if t]
    return tuple(dict.fromkeys(t for t in found if t in known))


def _from_json(text: str, plan: Plan) -> Review | None:
    start, end = text.find("{"), text.rfind("}")
    if start == -1 or end <= start:
        return None
    try:
        data = json.loads(text[start:end + 1])
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or str(data.get("verdict", "")).lower() not in ("accept", "revise"):
        return None
    failing = data.get("failing_steps") or data.get("failing") or []
    raw = " ".join(str(f) for f in failing) if isinstance(failing, list) else str(failing)
    verdict = str(data["verdict"]).lower()
    ids = _ids(raw, plan) if verdict == "revise" else ()
    return Review("revise" if ids else "accept", ids, str(data.get("answer") or ""))


def parse_review(text: str, plan: Plan) -> Review:
    """A revise verdict without any known failing step id counts as accept (nothing to re-run)."""
    as_json = _from_json(text, plan)
    if as_json is not None:
        return as_json
    verdict_match = _VERDICT.search(text)
    answer_match = _ANSWER.search(text)
    answer = text[answer_match.end():].strip() if answer_match else ""
    if verdict_match is None:
        return Review("accept", (), answer or text.strip(), parsed=False)
    if not answer:
        rest = text[verdict_match.end():]
        answer = "\n".join(line for line in rest.splitlines()[1:] if not _FAILING.match(line)).strip()
    failing: tuple[str, ...] = ()
    if verdict_match.group(1).lower() == "revise":
        failing_match = _FAILING.search(text)
        failing = _ids(failing_match.group(1), plan) if failing_match else ()
    return Review("revise" if failing else "accept", failing, answer)
