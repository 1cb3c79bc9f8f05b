"""Training on a tiny set, the target mix, and the artifact's refusal of mismatched or tampered files."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from classifier import (
    ARTIFACT_FORMAT,
    DEFAULT_TIER_MIX,
    FEATURE_VERSION,
    N_FEATURES,
    TIERS,
    ArtifactError,
    ClassifierError,
    TrainConfig,
    featurize,
    full_mix,
    load_artifact,
    metadata_path,
    save_artifact,
    train,
    user_prompt,
)
from classifier.train import TrainResult
from tests.classifier.synthetic import prompts_of, tiny_dataset


@pytest.fixture(scope="module")
def trained() -> TrainResult:
    return train(tiny_dataset(), TrainConfig(cv_folds=3), version="effort-test-1")


@pytest.fixture
def artifact(tmp_path: Path, trained: TrainResult) -> Path:
    path = tmp_path / "effort.skops"
    save_artifact(trained.model, path, data_hash=trained.data_hash, metrics={"cv": trained.cv.to_json()}
                  if trained.cv else {})
    return path


def test_tiny_model_separates_kinds_and_reports_cv(trained: TrainResult) -> None:
    m = trained.model
    easy = [m.decide(user_prompt(p)) for p in prompts_of(0, 10)]
    hard = [m.decide(user_prompt(p)) for p in prompts_of(3, 10)]
    assert max(d.score for d in easy) < min(d.score for d in hard)
    assert all(d.tier in ("medium", "high", "xhigh") for d in hard)  # top 10% of training → high band
    assert all(d.tier in ("none", "minimal", "low") for d in easy)
    assert all(abs(sum(d.probabilities.values()) - 1) < 1e-5 for d in easy + hard)
    assert trained.cv is not None and trained.cv.auroc_needs_medium > 0.9
    assert {t.tier for t in trained.cv.per_tier} == {"none", "low", "medium", "xhigh"}


def test_stored_thresholds_hit_the_six_tier_mix_on_the_reference(trained: TrainResult) -> None:
    examples = tiny_dataset()
    decisions = trained.model.decisions_matrix(featurize(examples))
    counts = np.bincount([TIERS.index(d.tier) for d in decisions], minlength=6) / len(decisions)
    assert trained.model.tier_shares == pytest.approx(full_mix(DEFAULT_TIER_MIX))
    # 160 examples in four tight clusters: a cut can only fall between whole prompts.
    assert counts == pytest.approx(trained.model.tier_shares, abs=0.05)


def test_round_trip_gives_identical_decisions(artifact: Path, trained: TrainResult) -> None:
    loaded = load_artifact(artifact)
    assert loaded.metadata["version"] == "effort-test-1"
    assert set(loaded.metadata["libraries"]) >= {"numpy", "scikit-learn", "skops", "python"}
    assert loaded.metadata["training_data_hash"] == trained.data_hash
    for p in [*prompts_of(2, 5), "请证明勾股定理。"]:
        assert loaded.model.decide(user_prompt(p)) == trained.model.decide(user_prompt(p))
    assert artifact.stat().st_size < 20 * 1024 * 1024


def test_tampered_artifact_is_refused(artifact: Path) -> None:
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifact.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256"):
        load_artifact(artifact)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("feature_version", "f0", "features"), ("format", 99, "format"), ("n_features", 12, "features")])
def test_version_mismatch_is_refused(artifact: Path, field: str, value: object, message: str) -> None:
    meta_file = metadata_path(artifact)
    meta = json.loads(meta_file.read_text())
    meta[field] = value
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=message):
        load_artifact(artifact)


def test_missing_metadata_and_untrusted_content_are_refused(artifact: Path, tmp_path: Path) -> None:
    metadata_path(artifact).unlink()
    with pytest.raises(ArtifactError, match="metadata"):
        load_artifact(artifact)
    # A skops file holding an arbitrary object type (not just arrays): refused before loading.
    import hashlib
    from fractions import Fraction

    import skops.io as sio

    bad = tmp_path / "bad.skops"
    sio.dump({"classes": ["low"], "payload": Fraction(1, 3), "f": np.sum}, bad)
    metadata_path(bad).write_text(json.dumps({"format": ARTIFACT_FORMAT, "feature_version": FEATURE_VERSION, "n_features": N_FEATURES,
                                              "sha256": hashlib.sha256(bad.read_bytes()).hexdigest()}))
    with pytest.raises(ArtifactError, match="trusted") as err:
        load_artifact(bad)
    assert "fractions.Fraction" in str(err.value)
    assert zipfile.is_zipfile(artifact)


def test_refit_without_cv_keeps_a_given_temperature() -> None:
    small = tiny_dataset(per_kind=10)
    assert train(small, cv=False, temperature=3.0).model.temperature == 3.0
    assert train(small, cv=False).model.temperature == 1.0


def test_target_mix_can_change_without_retraining(trained: TrainResult, artifact: Path) -> None:
    examples = tiny_dataset()
    model = load_artifact(artifact).model.with_target_mix({"low": 0.5, "medium": 0.3, "high": 0.2})
    assert model.tier_shares == pytest.approx((0.5 / 3, 0.5 / 3, 0.5 / 3, 0.3, 0.1, 0.1))
    _, scores = model.predict_matrix(featurize(examples))
    band = np.searchsorted(np.asarray(model.thresholds), scores, side="right")
    strong = np.bincount(band, minlength=6)[3:] / len(scores)  # the clusters are too tight for the lower cuts
    assert strong == pytest.approx([0.3, 0.1, 0.1], abs=0.06)
    import dataclasses

    with pytest.raises(ClassifierError, match="quantiles"):
        dataclasses.replace(trained.model, score_quantiles=()).with_target_mix({"low": 1.0})
