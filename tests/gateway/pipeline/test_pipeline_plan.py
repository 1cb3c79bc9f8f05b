"""Plan and review parsing: the tolerant formats accepted, and what is rejected."""

from __future__ import annotations

import pytest

from gateway.pipeline.plan import PlanInvalid, layers, parse_plan
from gateway.pipeline.review import parse_review
from tests.gateway.scripted_models import plan_json

PLAN = plan_json(("s1", "a", []), ("s2", "b", []), ("s3", "c", ["s1", "s2"]))


def test_json_plan_fenced_or_bare_object_or_array() -> None:
    for text in (PLAN, f"Here you go:\n```json\n{PLAN}\n```", '[{"instruction": "only step"}]'):
        plan = parse_plan(text, max_steps=4)
        assert plan.source == "json" and plan.steps
    plan = parse_plan(PLAN, 4)
    assert [[s.id for s in layer] for layer in layers(plan)] == [["s1", "s2"], ["s3"]]
    assert [s.id for s in plan.sinks()] == ["s3"]
    assert plan.dependants({"s1"}) == {"s1", "s3"}


def test_numbered_or_bulleted_list_becomes_a_chain() -> None:
    plan = parse_plan("Steps:\n1) first thing\n2. second thing\nStep 3: third thing", 4)
    assert plan.source == "list"
    assert [(s.id, s.depends_on) for s in plan.steps] == [("s1", ()), ("s2", ("s1",)), ("s3", ("s2",))]
    assert parse_plan("- one\n- two", 4).steps[1].instruction == "two"


def test_plain_lines_are_a_plan_only_in_the_repair_round() -> None:
    text = "work out the product\nthen add the rest\n!!"
    with pytest.raises(PlanInvalid):
        parse_plan(text, 4)
    plan = parse_plan(text, 4, allow_lines=True)
    assert plan.source == "lines" and [s.instruction for s in plan.steps] == ["work out the product",
                                                                               "then add the rest"]
    with pytest.raises(PlanInvalid):
        parse_plan("one single line of prose", 4, allow_lines=True)


@pytest.mark.parametrize(("text", "message"), [
    ("just prose", "no JSON object and no numbered list"),
    ('{"steps": []}', "non-empty"),
    ('{"steps": [{"id": "a", "instruction": "x", "depends_on": ["b"]}]}', "unknown step"),
    ('{"steps": [{"id": "a", "instruction": "x", "depends_on": ["b"]},'
     ' {"id": "b", "instruction": "y", "depends_on": ["a"]}]}', "cycle"),
    ('{"steps": [{"id": "a", "instruction": "x"}, {"id": "a", "instruction": "y"}]}', "unique"),
    ('{"steps": [{"id": "a"}]}', "no instruction"),
    (plan_json(*[(f"s{i}", "x", []) for i in range(5)]), "at most 4"),
])
def test_invalid_plans_say_why(text: str, message: str) -> None:
    with pytest.raises(PlanInvalid, match=message):
        parse_plan(text, max_steps=4)


def test_review_formats() -> None:
    plan = parse_plan(PLAN, 4)
    r = parse_review("VERDICT: revise\nFAILING: s2, s9\nANSWER:\nthe draft", plan)
    assert (r.verdict, r.failing_steps, r.answer) == ("revise", ("s2",), "the draft")
    r = parse_review('{"verdict": "revise", "failing_steps": ["s1"], "answer": "a"}', plan)
    assert (r.verdict, r.failing_steps) == ("revise", ("s1",))
    r = parse_review("**Verdict:** accept\nThe answer is 4.", plan)
    assert (r.verdict, r.answer) == ("accept", "The answer is 4.")
    r = parse_review("VERDICT: revise\nANSWER:\nno ids named", plan)
    assert r.verdict == "accept"  # nothing re-runnable
    r = parse_review("free text from a weak model", plan)
    assert (r.verdict, r.answer, r.parsed) == ("accept", "free text from a weak model", False)
