"""Outcome files: the generic per-arm format (full and partial), logged records, the two-model
columns, the documented BIG-Bench-Hard mapping, and refusals of malformed rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from classifier import (
    BBH_MAPPING,
    ClassifierError,
    OutcomeRecord,
    extract,
    items_to_records,
    load_outcome_items,
    load_outcome_records,
    load_outcomes,
    outcome_set_hash,
    save_outcome_records,
    user_prompt,
)
from classifier.payoff import load_outcome_sets
from tests.classifier.test_data import DATA


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_generic_format_full_and_partial(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "evals.jsonl", [
        {"prompt": "What is 2+2?", "outcomes": {"low": 1, "high": True}, "costs": {"low": 0.001, "high": 0.02},
         "group": "arith", "timestamp": 5, "tenant": "t1"},
        {"messages": [{"role": "user", "content": "Prove it."}], "outcomes": {"high": 0.5}, "group": "proof"},
        {"prompt": "Name a colour.", "arm": "none", "outcome": "yes", "cost": 0.0001},
    ])
    items = load_outcome_items(path)
    assert [dict(it.outcomes) for it in items] == [{"low": 1.0, "high": 1.0}, {"high": 0.5}, {"none": 1.0}]
    assert items[0].costs == {"low": 0.001, "high": 0.02} and items[0].group == "arith"
    assert items[0].timestamp == 5.0 and items[0].tenant == "t1"
    assert items[1].messages[-1]["content"] == "Prove it." and not items[1].has("low", "high")
    assert items[0].gain() == 0.0
    assert len(load_outcomes(path)) == 1  # only the first has both arms
    assert len(items_to_records(items)) == 4


def test_logged_records_round_trip(tmp_path: Path) -> None:
    records = [
        OutcomeRecord(arm="high", outcome=1.0, messages=user_prompt("Prove that 17 is prime."), cost=0.02,
                      propensity=0.05, timestamp=12.5, tenant="acme", group="maths", model="big", effort="high"),
        OutcomeRecord(arm="low", outcome=0.0, features=extract(user_prompt("secret prompt")), propensity=0.95),
    ]
    path = tmp_path / "log.jsonl"
    assert save_outcome_records(records, path) == 2
    back = load_outcome_records(path)
    assert back == records
    assert back[1].messages is None and back[1].features == records[1].features


def test_two_model_columns_and_the_bbh_mapping(tmp_path: Path) -> None:
    csv_path = tmp_path / "o.csv"
    csv_path.write_text("prompt,cheap,strong\nhello,true,true\nhard,false,1\n", encoding="utf-8")
    assert [(o.cheap, o.strong) for o in load_outcomes(csv_path)] == [(1.0, 1.0), (0.0, 1.0)]
    bbh = _jsonl(tmp_path / "bbh_direct_vs_cot.jsonl", [
        {"task": "navigate", "idx": 0, "input": "Take 3 steps. Turn left.", "target": "No", "direct_pred": "Yes",
         "direct_correct": False, "cot_pred": "No", "cot_correct": True},
        {"task": "snarks", "idx": 1, "input": "Which is sarcastic?", "target": "(A)", "direct_pred": "(A)",
         "direct_correct": True, "cot_pred": "(B)", "cot_correct": False}])
    items = load_outcome_items(bbh)  # recognised from its fields
    assert items == load_outcome_items(bbh, BBH_MAPPING)
    assert [dict(it.outcomes) for it in items] == [{"low": 0.0, "high": 1.0}, {"low": 1.0, "high": 0.0}]
    assert [it.group for it in items] == ["navigate", "snarks"]
    assert items[0].messages == user_prompt("Take 3 steps. Turn left.")
    assert outcome_set_hash(items) == outcome_set_hash(load_outcome_items(bbh))
    assert outcome_set_hash(items) != outcome_set_hash(items[:1])


def test_outcome_folder_of_the_shared_data() -> None:
    if not (DATA / "outcomes" / "bbh_direct_vs_cot.jsonl").exists():
        pytest.skip("shared data folder absent")
    sets = load_outcome_sets(DATA)
    items = sets["bbh_direct_vs_cot"]
    assert len(items) == 6511 and len({it.group for it in items}) == 27
    assert all(it.has("low", "high") for it in items)


@pytest.mark.parametrize(("row", "message"), [
    ({"prompt": "x", "cheap": "maybe", "strong": 1}, "neither a boolean nor a number"),
    ({"prompt": "x", "outcomes": {"high": 1.5}}, "outside"),
    ({"cheap": 1, "strong": 1}, "'prompt' or 'messages'"),
])
def test_malformed_rows_are_refused(tmp_path: Path, row: dict[str, object], message: str) -> None:
    with pytest.raises(ClassifierError, match=message):
        load_outcome_items(_jsonl(tmp_path / "bad.jsonl", [row]))


def test_records_need_a_valid_propensity_and_arm(tmp_path: Path) -> None:
    with pytest.raises(ClassifierError, match="propensity"):
        load_outcome_records(_jsonl(tmp_path / "a.jsonl", [{"prompt": "x", "arm": "low", "outcome": 1,
                                                            "propensity": 0}]))
    with pytest.raises(ClassifierError, match="'arm' and 'outcome'"):
        load_outcome_records(_jsonl(tmp_path / "b.jsonl", [{"prompt": "x", "outcome": 1}]))
