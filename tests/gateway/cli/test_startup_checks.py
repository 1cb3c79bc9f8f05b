"""Start-up that tells the truth (issue 15): paths in config.yaml resolve against the config
file's folder whatever the current directory (a model or classifier artifact not found there:
the tiergate installation's bundled one of that name, so a copied config.yaml works), and
`tiergate serve` / `tiergate worker` refuse to start — exit 2, naming each absolute path — when
a tier's local model directory has no config.json or a required classifier artifact is missing
(before: a copied config.yaml started, /readyz said ready, and every request was a 502 naming a
relative path)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from gateway.cli import serve, worker
from gateway.learning.perceive import artifact_candidates
from gateway.providers.local import LocalEngineProvider
from gateway.settings import load_settings

ROOT = Path(__file__).resolve().parents[3]
TIERS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _root() -> typer.Typer:
    root = typer.Typer()
    serve.register(root)
    worker.register(root)
    return root


def test_the_shipped_config_has_every_file_it_names() -> None:
    assert load_settings(ROOT / "config.yaml").startup_problems() == []


def test_a_copied_config_finds_the_bundled_model_and_classifier(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    copied = tmp_path / "elsewhere" / "config.yaml"
    copied.parent.mkdir()
    shutil.copy(ROOT / "config.yaml", copied)
    monkeypatch.chdir(tmp_path)
    settings = load_settings(copied)
    assert settings.startup_problems() == []
    demo = settings.models["demo-moe"]
    assert LocalEngineProvider(settings).model_path(demo) == ROOT / "engine" / "models" / "demo-moe"
    assert ROOT / "classifier" / "artifacts" / "effort.skops" in artifact_candidates(settings)
    assert settings.resolve_path(settings.database.default_url.removeprefix("sqlite:///")).parent == \
        copied.parent / "var"  # what the gateway writes stays beside the config


@pytest.mark.slow
def test_a_config_naming_missing_files_is_refused_at_start_with_absolute_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERGATE_CONFIG", raising=False)
    raw = yaml.safe_load((ROOT / "config.yaml").read_text())
    raw["models"]["demo-moe"]["model"] = "engine/models/not-there"
    raw["classifier"]["artifact"] = "classifier/artifacts/not-there.skops"
    config = tmp_path / "elsewhere" / "config.yaml"
    config.parent.mkdir()
    config.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(ROOT)
    problems = load_settings(config).startup_problems()
    beside, bundled = config.parent / "engine" / "models" / "not-there", ROOT / "engine" / "models" / "not-there"
    assert any(str(beside) in p and str(bundled) in p and "config.json" in p for p in problems), problems
    assert any(str(config.parent / "classifier" / "artifacts" / "not-there.skops") in p for p in problems), problems
    for command in ("serve", "worker"):
        result = CliRunner().invoke(_root(), [command, "--config", str(config)])
        assert result.exit_code == 2, result.output
        assert str(beside) in result.output and "not-there.skops" in result.output


def test_relative_paths_resolve_against_the_config_file_not_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "cfg" / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    config = tmp_path / "cfg" / "config.yaml"
    config.write_text(yaml.safe_dump({
        "models": {"m": {"provider": "local", "model": "models/tiny"}},
        "tiers": {t: {"model": "m"} for t in TIERS},
        "classifier": {"artifact": "artifacts/effort.skops", "required": False}}))
    monkeypatch.chdir(tmp_path)  # not the config's folder
    settings = load_settings(config)
    assert settings.startup_problems() == []
    settings = settings.model_copy(update={"classifier": settings.classifier.model_copy(update={"required": True})})
    [problem] = settings.startup_problems()
    assert str(tmp_path / "cfg" / "artifacts" / "effort.skops") in problem
    (model / "config.json").unlink()
    assert any(str(model) in p for p in settings.startup_problems())
