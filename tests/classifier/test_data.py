"""The dataset builder over the shared data folder (skipped where the folder is absent)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from classifier import ClassifierError, build_dataset, dataset_hash
from classifier.data import normalise

DATA = Path(os.environ.get("TIERGATE_DATA_DIR", Path(__file__).resolve().parents[3] / "shared" / "data"))


@pytest.fixture(scope="module")
def examples() -> list:
    if not (DATA / "MANIFEST.md").exists():
        pytest.skip(f"shared data folder not at {DATA}")
    return build_dataset(DATA)


def test_every_tier_and_many_sources_present(examples: list) -> None:
    tiers = Counter(e.tier for e in examples)
    assert set(tiers) == {"none", "minimal", "low", "medium", "high", "xhigh"}
    assert len({e.source for e in examples}) >= 15
    assert all(0.0 <= e.score <= 1.0 for e in examples)


def test_gsm_hard_is_never_used(examples: list) -> None:
    assert not any("hard" in e.source for e in examples)
    gsm_hard = (DATA / "qwen_math_eval" / "gsm_hard.jsonl").read_text(encoding="utf-8")
    assert '"input":"Janet\\u2019s ducks lay 16 eggs per day' in gsm_hard  # the file exists and is GSM8K test
    texts = {normalise(str(e.messages[0]["content"])) for e in examples}
    assert not any("janet’s ducks lay 16 eggs per day" in t for t in texts)


def test_deduplicated_and_signal_mapped(examples: list) -> None:
    keys = [normalise(str(e.messages[0]["content"])) for e in examples if not e.meta.get("augmented")]
    assert len(keys) == len(set(keys))
    by_source: dict[str, list] = {}
    for e in examples:
        by_source.setdefault(e.source, []).append(e)
    levels = {round(e.score, 2) for e in by_source["math"]}
    assert levels == {0.35, 0.45, 0.55, 0.65, 0.75}  # MATH Level 1..5
    assert {e.tier for e in by_source["leetcode"]} == {"low", "medium", "high"}
    assert {e.tier for e in by_source["arc_easy"]} == {"low"} and {e.tier for e in by_source["arc_challenge"]} == {"medium"}
    assert {e.tier for e in by_source["aime24"]} == {"xhigh"} and {e.tier for e in by_source["nq_open"]} == {"none"}
    assert dataset_hash(examples[:100]) == dataset_hash(examples[:100])
    assert dataset_hash(examples[:100]) != dataset_hash(examples[1:101])


def test_augmented_variants_keep_the_last_turns_label(examples: list) -> None:
    originals = {normalise(str(e.messages[-1]["content"])): e for e in examples if not e.meta.get("augmented")}
    variants = [e for e in examples if e.meta.get("augmented")]
    kinds = Counter(e.meta["augmented"] for e in variants)
    assert kinds["system"] > 500 and kinds["multi_turn"] > 500
    assert len(variants) < 0.06 * len(originals)  # a small share, not a second copy of the data
    for v in variants:
        base = originals[normalise(str(v.messages[-1]["content"]))]
        assert (v.tier, v.score, v.source) == (base.tier, base.score, base.source)
        assert v.messages[-1]["role"] == "user" and len(v.messages) in (2, 3)
        if v.meta["augmented"] == "multi_turn":
            prev = originals[normalise(str(v.messages[0]["content"]))]
            assert prev.source == v.source  # context comes from the same source: no label leaks across


def test_wrong_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ClassifierError, match="MANIFEST"):
        build_dataset(tmp_path)
