"""The Perceiver: decisions from the artifact, hot reload (foreground and background), refusal of
a tampered replacement, feedback storage honouring prompt privacy, and the full loop
feedback → `classifier update` → reload → different decisions."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import classifier
from classifier import TrainConfig, save_artifact, train, user_prompt
from gateway.cli.classifier_cmd import run_update
from gateway.db.models import Base, Feedback
from gateway.db.session import make_engine, make_session_factory
from gateway.learning.perceive import (
    FeedbackRecorder,
    Perceiver,
    artifact_candidates,
    build_perceiver,
    feedback_examples,
    feedback_fields,
    record_verdict,
)
from gateway.settings import Settings, settings_from_dict
from tests.classifier.synthetic import KINDS, prompts_of, tiny_dataset

MIX_DEFAULT = {"low": 0.7, "medium": 0.2, "high": 0.1}
MIX_HEAVY = {"low": 0.1, "medium": 0.1, "high": 0.8}


def _write(path: Path, mix: dict[str, float], version: str) -> None:
    result = train(tiny_dataset(), TrainConfig(target_mix=mix), cv=False, version=version)
    save_artifact(result.model, path, data_hash=result.data_hash)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("artifacts")
    out = {"v1": d / "v1.skops", "v2": d / "v2.skops"}
    _write(out["v1"], MIX_DEFAULT, "effort-v1")
    _write(out["v2"], MIX_HEAVY, "effort-v2")
    return out


def _install(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    classifier.metadata_path(dst).write_bytes(classifier.metadata_path(src).read_bytes())
    dst.write_bytes(src.read_bytes())


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def _settings(tmp_path: Path) -> Settings:
    return settings_from_dict({"models": {"m": {"provider": "local", "model": "x"}},
                               "tiers": {t: {"model": "m"} for t in classifier.TIERS},
                               "database": {"default_url": f"sqlite:///{tmp_path / 'db.sqlite'}"}},
                              base_dir=tmp_path)


def _db(tmp_path: Path) -> sessionmaker[Session]:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    Base.metadata.create_all(engine)
    return make_session_factory(engine)


ARITH = [user_prompt(p) for p in prompts_of(1, 12)]


@pytest.mark.slow
def test_decides_and_hot_reloads_the_preferred_artifact(tmp_path: Path, artifacts: dict[str, Path]) -> None:
    shipped, live = tmp_path / "shipped.skops", tmp_path / "var" / "effort.skops"
    _install(artifacts["v1"], shipped)
    clock = FakeClock()
    p = Perceiver([live, shipped], reload_interval_s=5, clock=clock, background=False)
    before = [p.decide(m) for m in ARITH]
    assert {d.version for d in before} == {"effort-v1"}
    assert all(d.tier in ("none", "minimal", "low") for d in before)
    _install(artifacts["v2"], live)
    clock.now = 4.0
    assert p.decide(ARITH[0]).version == "effort-v1"  # not checked again before the interval
    clock.now = 6.0
    after = [p.decide(m) for m in ARITH]
    assert {d.version for d in after} == {"effort-v2"}
    assert [d.tier for d in after] != [d.tier for d in before]


def test_background_reload_swaps_without_blocking(tmp_path: Path, artifacts: dict[str, Path]) -> None:
    path = tmp_path / "effort.skops"
    _install(artifacts["v1"], path)
    clock = FakeClock()
    p = Perceiver([path], reload_interval_s=1, clock=clock)
    _install(artifacts["v2"], path)
    clock.now = 2.0
    assert p.decide(ARITH[0]).version == "effort-v1"  # the load runs on a thread
    deadline = time.monotonic() + 30
    while p.version != "effort-v2" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.version == "effort-v2"


def test_tampered_replacement_is_refused_and_old_model_kept(tmp_path: Path, artifacts: dict[str, Path]) -> None:
    path = tmp_path / "effort.skops"
    _install(artifacts["v1"], path)
    p = Perceiver([path], reload_interval_s=0, background=False)
    classifier.metadata_path(path).write_bytes(classifier.metadata_path(artifacts["v2"]).read_bytes())
    data = bytearray(artifacts["v2"].read_bytes())
    data[len(data) // 3] ^= 0x55
    path.write_bytes(bytes(data))
    assert p.reload_now() is False
    assert p.decide(ARITH[0]).version == "effort-v1"
    _install(artifacts["v2"], path)  # a good file later is picked up
    assert p.decide(ARITH[0]).version == "effort-v2"


def test_build_perceiver_without_artifact_and_with_one(tmp_path: Path, artifacts: dict[str, Path]) -> None:
    settings = _settings(tmp_path)
    assert build_perceiver(settings) is None
    _install(artifacts["v1"], artifact_candidates(settings)[1])
    p = build_perceiver(settings)
    assert p is not None and p.version == "effort-v1"


def test_feedback_keeps_text_only_when_allowed(tmp_path: Path) -> None:
    sf = _db(tmp_path)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "secret plan: 2+2?"}]
    text, feats = feedback_fields(msgs, allow_text=False)
    record_verdict(sf, "chatcmpl-1", "ten_1", "medium", 0.5, text, feats)
    text, feats = feedback_fields(msgs, allow_text=True)
    record_verdict(sf, "chatcmpl-2", "ten_1", "high", None, text, feats, source="user")
    with sf() as s:
        rows = {r.request_id: r for r in s.scalars(sa.select(Feedback))}
    assert rows["chatcmpl-1"].prompt_text is None and rows["chatcmpl-1"].features["v"] == classifier.FEATURE_VERSION
    assert "secret plan" not in str(rows["chatcmpl-1"].features)
    assert "secret plan" in rows["chatcmpl-2"].prompt_text and rows["chatcmpl-2"].source == "user"
    examples, skipped = feedback_examples(sf, weight=3.0)
    assert skipped == 0 and len(examples) == 2
    by_tier = {e.tier: e for e in examples}
    assert by_tier["medium"].features is not None and by_tier["medium"].messages is None
    assert by_tier["high"].messages == [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "secret plan: 2+2?"}]
    assert all(e.weight == 3.0 and e.source == "feedback" for e in examples)
    # Features computed from the stored vector equal those of the original conversation.
    assert by_tier["medium"].features == classifier.extract(msgs)
    with pytest.raises(ValueError):
        record_verdict(sf, "chatcmpl-3", "ten_1", "extreme", None, None, None)


@dataclass
class Verdict:
    request_id: str
    tenant_id: str
    label_tier: str
    messages: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    allow_prompt_storage: bool = False


def test_pipeline_feedback_sink_stores_off_thread(tmp_path: Path) -> None:
    sf = _db(tmp_path)
    sink = FeedbackRecorder(sf, _settings(tmp_path))
    sink(Verdict("chatcmpl-a", "ten_1", "high", ({"role": "user", "content": "private"},)))
    sink(Verdict("chatcmpl-b", "ten_1", "low", ({"role": "user", "content": "shareable"},), True))
    sink(Verdict("chatcmpl-c", "ten_1", "extreme"))  # a bad row is logged, not raised
    sink.close()
    with sf() as s:
        rows = {r.request_id: r for r in s.scalars(sa.select(Feedback))}
    assert set(rows) == {"chatcmpl-a", "chatcmpl-b"}
    assert rows["chatcmpl-a"].prompt_text is None and rows["chatcmpl-a"].features is not None
    assert "shareable" in rows["chatcmpl-b"].prompt_text
    assert rows["chatcmpl-a"].source == "review" and rows["chatcmpl-a"].score == 0.75


def test_feedback_update_and_hot_reload_change_decisions(tmp_path: Path, artifacts: dict[str, Path]) -> None:
    settings = _settings(tmp_path)
    sf = _db(tmp_path)
    _install(artifacts["v1"], artifact_candidates(settings)[1])
    clock = FakeClock()
    p = Perceiver(artifact_candidates(settings), reload_interval_s=5, clock=clock, background=False)
    before = [p.decide(m) for m in ARITH]
    assert all(d.tier in ("none", "minimal", "low") for d in before)
    # Reviews keep saying arithmetic word problems needed xhigh (half stored as features only).
    for i, m in enumerate(ARITH):
        text, feats = feedback_fields(m, allow_text=i % 2 == 0)
        record_verdict(sf, f"chatcmpl-{i}", "ten_1", "xhigh", 0.95, text, feats)
    outcome = run_update(settings, sf, tiny_dataset(), weight=5.0)
    assert outcome is not None and outcome.parent == "effort-v1" and outcome.feedback_examples == len(ARITH)
    assert outcome.versioned_path.exists() and outcome.live_path == artifact_candidates(settings)[0]
    clock.now = 10.0
    after = [p.decide(m) for m in ARITH]
    assert {d.version for d in after} == {outcome.version}
    assert sum(d.score for d in after) > sum(d.score for d in before)
    band = {t: i for i, t in enumerate(classifier.TIERS)}
    # at least one band up on average, and some beyond the cheap tiers
    assert sum(band[d.tier] for d in after) >= sum(band[d.tier] for d in before) + len(ARITH)
    assert any(d.tier not in ("none", "minimal", "low") for d in after)


def test_config_target_mix_rederives_thresholds(tmp_path: Path, artifacts: dict[str, Path]) -> None:
    path = tmp_path / "effort.skops"
    _install(artifacts["v1"], path)
    plain = Perceiver([path])
    heavy = Perceiver([path], target_mix=MIX_HEAVY)
    assert heavy.version == plain.version == "effort-v1"
    assert heavy.model.thresholds[0] < plain.model.thresholds[0]
    tiers = [heavy.decide(m).tier for m in ARITH]
    assert sum(t not in ("none", "minimal", "low") for t in tiers) > sum(
        plain.decide(m).tier not in ("none", "minimal", "low") for m in ARITH)
    settings = settings_from_dict({**_settings(tmp_path).model_dump(exclude={"base_dir"}),
                                   "classifier": {"artifact": str(path), "target_mix": MIX_HEAVY}},
                                  base_dir=tmp_path)
    assert Perceiver.from_settings(settings).model.thresholds == heavy.model.thresholds


def test_a_quality_or_cost_target_sets_the_strong_share(tmp_path: Path) -> None:
    """A tenant's quality target ("keep >= X of the all-strong quality") takes the strong share from
    the router's quality curve (published with it, measured on outcomes); a cost target from the
    tiers' costs; with neither, the target mix. Thresholds follow the traffic window either way."""
    from classifier.thresholds import full_mix, strong_share_for_cost, strong_share_for_quality
    from gateway.routing import RoutingPrefs

    shares = [i / 10 for i in range(11)]
    pgr = [0.0, 0.5, 0.7, 0.8, 0.86, 0.9, 0.93, 0.96, 0.98, 0.99, 1.0]
    path = tmp_path / "effort.skops"
    result = train(tiny_dataset(), TrainConfig(), cv=False, version="curved")
    save_artifact(result.model, path, data_hash=result.data_hash,
                  extra={"quality_curve": {"shares": shares, "pgr": pgr}})
    mix = {"low": 0.7, "medium": 0.2, "high": 0.1}
    perceiver = Perceiver([path], background=False, target_mix=mix, exploration=0.0)
    perceiver.tier_costs = {"none": 1.0, "minimal": 1.0, "low": 1.0, "medium": 5.0, "high": 20.0, "xhigh": 20.0}
    texts = [t for kind in range(len(KINDS)) for t in prompts_of(kind, 150, seed=kind)]
    random.Random(0).shuffle(texts)
    for text in texts[:300]:  # warm the traffic window
        perceiver.decide(user_prompt(text))

    def strong_share(prefs: RoutingPrefs) -> float:
        tiers = [perceiver.decide(user_prompt(t), None, prefs).tier for t in texts[:600]]
        return sum(t in ("high", "xhigh") for t in tiers) / len(tiers)

    expected_q = strong_share_for_quality(np.asarray(shares), np.asarray(pgr), 0.85)
    expected_c = strong_share_for_cost(full_mix(mix), perceiver.tier_costs, 0.3)
    assert strong_share(RoutingPrefs()) == pytest.approx(0.1, abs=0.05)
    assert strong_share(RoutingPrefs(target_quality=0.85)) == pytest.approx(expected_q, abs=0.06)
    assert strong_share(RoutingPrefs(target_cost=0.3)) == pytest.approx(expected_c, abs=0.06)
    assert expected_q > 0.3 and abs(expected_c - 0.1) > 0.05  # the targets moved the mix
