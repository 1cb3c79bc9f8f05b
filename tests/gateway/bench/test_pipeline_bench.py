"""``tiergate bench pipeline`` pieces: the workload mix from a data folder, and the replay's
accounting (routed cost from the real pipeline vs the all-high and all-low baselines)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from gateway.bench.pipeline import (
    ANSWER_TOKENS,
    HIGH_REASONING_TOKENS,
    bench_settings,
    prompt_tokens,
    replay,
    report,
)
from gateway.bench.workload import WorkItem, sample_workload
from gateway.ledger.pricing import cost_nanos_for
from gateway.providers.base import Usage


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")


def test_workload_follows_the_mix(tmp_path: Path) -> None:
    _write(tmp_path / "nq_open/NQ-open.dev.jsonl", [{"question": f"who is {i}"} for i in range(20)])
    _write(tmp_path / "gsm8k/train.jsonl", [{"question": f"word problem {i}"} for i in range(20)])
    _write(tmp_path / "math/MATH_test_5000.jsonl", [{"problem": f"hard {i}", "level": "Level 5"} for i in range(20)])
    items = sample_workload(tmp_path, 100, (0.7, 0.2, 0.1), seed=1)
    assert Counter(i.difficulty for i in items) == {"easy": 70, "medium": 20, "hard": 10}
    assert {i.source for i in items} == {"nq_open", "gsm8k", "math_l4_5"}


async def test_replay_prices_routes_against_all_high_and_all_low() -> None:
    items = [WorkItem("nq_open", "easy", "none", "who wrote hamlet"),
             WorkItem("gsm8k", "medium", "medium", "a word problem " * 10),
             WorkItem("math_l4_5", "hard", "high", "a hard problem " * 20),
             WorkItem("olympiadbench", "hard", "xhigh", "an olympiad problem " * 20)]
    totals = await replay(items, None, seed=0)
    settings = bench_settings()
    expected_high = sum(cost_nanos_for(settings, "high", "frontier", Usage(
        prompt_tokens([{"role": "user", "content": i.prompt}]),
        ANSWER_TOKENS[i.difficulty] + HIGH_REASONING_TOKENS[i.difficulty]))[0] for i in items)
    assert totals.all_high == expected_high
    assert dict(totals.effort) == {"none": 1, "medium": 1, "high": 1, "xhigh": 1}
    assert totals.pruned_paths >= 4  # xhigh: one falling path cut per step
    assert totals.all_low < totals.routed < totals.all_high
    assert totals.pipeline_cost == totals.cost_by_effort["high"] + totals.cost_by_effort["xhigh"]
    text = report(totals, n=4, mix=(0.7, 0.2, 0.1), seed=0, decided_by="FALLBACK: test", data_dir=Path("x"))
    assert f"routed / all-high = {totals.routed / totals.all_high:.3f}" in text and "FALLBACK" in text


def test_without_a_classifier_artifact_the_fallback_is_labelled(tmp_path: Path) -> None:
    from gateway.bench.pipeline import load_decider
    from tests.gateway.scripted_models import scripted_settings

    assert load_decider(None) == (None, "classifier disabled with --no-classifier")
    settings = scripted_settings().model_copy(update={"base_dir": str(tmp_path)})
    decide, why = load_decider(settings)
    assert decide is None and why.startswith("no classifier artifact at ") and str(tmp_path) in why
