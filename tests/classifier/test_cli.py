"""`tiergate classifier eval|explain|bench` on a tiny artifact and a synthetic outcomes file.

The outcomes here are synthetic (cheap model fails the harder kinds more often), made only to
exercise the command; they say nothing about real routing quality."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from classifier import TrainConfig, save_artifact, train
from gateway.cli.classifier_cmd import app as cli_app
from tests.classifier.synthetic import prompts_of, tiny_dataset
from tests.classifier.test_data import DATA

runner = CliRunner()


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "effort.skops"
    result = train(tiny_dataset(), TrainConfig(), cv=False, version="effort-cli-test")
    save_artifact(result.model, path, data_hash=result.data_hash)
    return path


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    tiers = "\n".join(f"  {t}: {{model: m}}" for t in ("none", "minimal", "low", "medium", "high", "xhigh"))
    path.write_text(f"models:\n  m: {{provider: local, model: x}}\ntiers:\n{tiers}\n", encoding="utf-8")
    return path


def _outcomes(path: Path, n_per_kind: int = 30) -> None:
    r = random.Random(0)
    fail_rate = [0.05, 0.15, 0.5, 0.8]  # cheap model fails harder kinds more often
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["prompt", "cheap", "strong"])
        for kind, rate in enumerate(fail_rate):
            for p in prompts_of(kind, n_per_kind, seed=10 + kind):
                w.writerow([p, "false" if r.random() < rate else "true", "true" if r.random() < 0.95 else "false"])


@pytest.mark.slow
def test_eval_reports_router_against_baselines(tmp_path: Path, artifact: Path, config: Path) -> None:
    outcomes = tmp_path / "outcomes.csv"
    _outcomes(outcomes)
    res = runner.invoke(cli_app, ["eval", "--outcomes", str(outcomes), "--artifact", str(artifact),
                                  "--config", str(config), "--bootstrap", "30", "--prequential", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert set(report) == {"classifier", "prequential", "random", "oracle"}
    assert report["random"]["apgr"] == pytest.approx(0.5)
    assert report["random"]["cpt50"] == pytest.approx(0.5)
    assert report["classifier"]["apgr"] > 0.6  # the score knows which kinds the cheap model fails
    assert report["oracle"]["apgr"] >= report["classifier"]["apgr"]
    low, high = report["classifier"]["ci"]["apgr"]
    assert low <= report["classifier"]["apgr"] <= high
    text = runner.invoke(cli_app, ["eval", "--outcomes", str(outcomes), "--artifact", str(artifact),
                                   "--config", str(config), "--bootstrap", "0"])
    assert text.exit_code == 0 and "APGR" in text.output and "oracle" in text.output


def test_eval_refuses_bad_outcomes(tmp_path: Path, artifact: Path, config: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "cheap": "maybe", "strong": 1}) + "\n", encoding="utf-8")
    res = runner.invoke(cli_app, ["eval", "--outcomes", str(bad), "--artifact", str(artifact),
                                  "--config", str(config)])
    assert res.exit_code == 2 and "neither a boolean nor a number" in res.output


def test_explain_shows_tier_probabilities_and_features(artifact: Path, config: Path) -> None:
    res = runner.invoke(cli_app, ["explain", prompts_of(3, 1)[0], "--artifact", str(artifact),
                                  "--config", str(config), "--top", "5"])
    assert res.exit_code == 0, res.output
    assert "effort-cli-test" in res.output and "probabilities" in res.output
    assert len([ln for ln in res.output.splitlines() if ln.strip()]) >= 5 + 4


@pytest.mark.slow
def test_bench_prints_percentiles_and_ratio(artifact: Path, config: Path) -> None:
    if not (DATA / "MANIFEST.md").exists():
        pytest.skip("shared data folder absent")
    res = runner.invoke(cli_app, ["bench", "--artifact", str(artifact), "--config", str(config),
                                  "--data", str(DATA), "--n", "100", "--repeat", "1"])
    assert res.exit_code == 0, res.output
    assert "p50 ms" in res.output and "ratio decide / json.loads body" in res.output
