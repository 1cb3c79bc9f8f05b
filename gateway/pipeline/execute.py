"""The execute stage: runs a plan's steps as a DAG. Each step starts as soon as the steps it
depends on have finished (independent steps run concurrently); a step's prompt carries the
request, its instruction, expected output and the outputs of the steps it depends on.

How one step is run (one call, or several pruned paths) is injected as ``run_step``.
A step that cannot be afforded (cost cap or budget: ``StopEarly``) stops the stage: finished outputs are
kept, steps depending on unfinished ones are not started. Upstream errors propagate.

Imports pipeline plan/accounting only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.pipeline.accounting import StopEarly
from gateway.pipeline.plan import Plan, PlanStep

STEP_SYSTEM = ("You carry out one step of a larger plan. Do exactly this step and reply with its "
               "result only, concisely.")

RunStep = Callable[[PlanStep, list[dict[str, Any]]], Awaitable[str]]


@dataclass
class ExecutionResult:
    outputs: dict[str, str] = field(default_factory=dict)
    stopped: StopEarly | None = None


def request_text(messages: list[dict[str, Any]]) -> str:
    """The conversation as plain text, for prompts of later stages."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', 'user')}: {content or ''}")
    return "\n".join(parts)


def step_messages(request: str, step: PlanStep, dependency_outputs: dict[str, str]) -> list[dict[str, Any]]:
    lines = [f"Request:\n{request}", f"Your step ({step.id}): {step.instruction}"]
    if step.expected_output:
        lines.append(f"Expected output: {step.expected_output}")
    for dep_id in step.depends_on:
        lines.append(f"Result of step {dep_id}:\n{dependency_outputs.get(dep_id, '')}")
    return [{"role": "system", "content": STEP_SYSTEM}, {"role": "user", "content": "\n\n".join(lines)}]


async def execute_plan(plan: Plan, request: str, run_step: RunStep, *, only: set[str] | None = None,
                       previous: dict[str, str] | None = None) -> ExecutionResult:
    """Run ``only`` these steps (default: all), reusing ``previous`` outputs for the others."""
    result = ExecutionResult(outputs=dict(previous or {}))
    todo = [s for s in plan.steps if only is None or s.id in only]
    finished: dict[str, asyncio.Event] = {s.id: asyncio.Event() for s in todo}
    for s in plan.steps:
        if s.id not in finished:
            finished[s.id] = asyncio.Event()
            finished[s.id].set()

    async def run_one(step: PlanStep) -> None:
        try:
            for dep in step.depends_on:
                await finished[dep].wait()
            if result.stopped is not None or any(d not in result.outputs for d in step.depends_on):
                return
            messages = step_messages(request, step, {d: result.outputs[d] for d in step.depends_on})
            try:
                result.outputs[step.id] = await run_step(step, messages)
            except StopEarly as err:
                result.stopped = result.stopped or err
                result.outputs.pop(step.id, None)
        finally:
            finished[step.id].set()

    for s in todo:
        result.outputs.pop(s.id, None)
    try:
        async with asyncio.TaskGroup() as group:
            for s in todo:
                group.create_task(run_one(s))
    except BaseExceptionGroup as group_error:
        raise group_error.exceptions[0] from None
    return result
