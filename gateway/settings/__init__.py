"""Typed configuration: config.yaml plus environment, parsed once.

Secrets are never stored in config.yaml; fields ending in ``_env`` name the
environment variable that holds them. Must not import anything from the gateway
besides its own errors and ``gateway.money`` (it sits below every other module).
One module per concern (``services``, ``models``, ``policy``, ``observability``); every name is
importable from ``gateway.settings``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError, field_validator, model_validator

from gateway.settings.base import DEFAULT_CONFIG_ENV, TIER_NAMES, ConfigError, Tier, _Strict
from gateway.settings.models import EngineKnobs, ModelEngineSettings, ModelSettings, Price, TierSettings
from gateway.settings.observability import (
    LogSettings,
    MetricsSettings,
    ObservabilitySettings,
    TracingSettings,
)
from gateway.settings.policy import (
    CLASSIFIER_CURRENT_NAME,
    INSTALL_ROOT,
    BudgetDefaults,
    ClassifierSettings,
    PipelineSettings,
    RoutingSettings,
)
from gateway.settings.services import (
    DatabaseSettings,
    JobsSettings,
    LedgerSettings,
    RedisSettings,
    ServerSettings,
)

__all__ = ["CLASSIFIER_CURRENT_NAME", "DEFAULT_CONFIG_ENV", "INSTALL_ROOT", "TIER_NAMES", "BudgetDefaults",
           "ClassifierSettings", "ConfigError", "DatabaseSettings", "EngineKnobs", "JobsSettings", "LedgerSettings",
           "LogSettings", "MetricsSettings", "ModelEngineSettings", "ModelSettings", "ObservabilitySettings",
           "PipelineSettings", "Price", "RedisSettings", "RoutingSettings", "ServerSettings", "Settings", "Tier",
           "TierSettings", "TracingSettings", "load_settings", "settings_from_dict"]


class Settings(_Strict):
    server: ServerSettings = ServerSettings()
    database: DatabaseSettings = DatabaseSettings()
    redis: RedisSettings = RedisSettings()
    ledger: LedgerSettings = LedgerSettings()
    models: dict[str, ModelSettings]
    tiers: dict[Tier, TierSettings]
    budgets: BudgetDefaults = BudgetDefaults()
    routing: RoutingSettings = RoutingSettings()
    classifier: ClassifierSettings = ClassifierSettings()
    pipeline: PipelineSettings = PipelineSettings()
    jobs: JobsSettings = JobsSettings()
    observability: ObservabilitySettings = ObservabilitySettings()
    base_dir: str = "."

    @field_validator("tiers")
    @classmethod
    def _all_tiers(cls, tiers: dict[str, TierSettings]) -> dict[str, TierSettings]:
        missing = [t for t in TIER_NAMES if t not in tiers]
        if missing:
            raise ValueError(f"missing tiers: {', '.join(missing)}")
        return tiers

    @model_validator(mode="after")
    def _tier_models_exist(self) -> Settings:
        for name, tier in self.tiers.items():
            for model in (tier.model, *tier.fallbacks):
                if model not in self.models:
                    raise ValueError(f"tiers.{name}: unknown model {model!r} (not under models:)")
            target = self.models[tier.model]
            if tier.engine.speculative == "draft" and target.provider == "local" and target.draft_model is None:
                raise ValueError(f"tiers.{name}: engine.speculative 'draft' needs models.{tier.model}.draft_model")
        return self

    def tier_price(self, tier: str) -> Price:
        t = self.tiers[tier]  # type: ignore[index]
        return t.price or self.models[t.model].price

    def resolve_path(self, path: str) -> Path:
        """``path`` as given when absolute, else relative to the config file's folder (``base_dir``),
        whatever the current directory."""
        p = Path(path)
        return p if p.is_absolute() else Path(self.base_dir) / p

    def asset_paths(self, path: str) -> list[Path]:
        """Where a read-only file the config names (a local model directory, the classifier
        artifact) is looked for, in order: relative to the config file's folder, then — for a
        relative path — in the tiergate installation, where the bundled demo model and
        classifier live (so a copied config.yaml still finds them). Absolute paths."""
        p = Path(path)
        if p.is_absolute():
            return [p]
        beside = (Path(self.base_dir) / p).resolve()
        bundled = (INSTALL_ROOT / p).resolve()
        return [beside] if bundled == beside else [beside, bundled]

    def resolve_asset(self, path: str) -> Path:
        """The first of ``asset_paths`` that exists (the config-relative one when none does)."""
        paths = self.asset_paths(path)
        return next((x for x in paths if x.exists()), paths[0])

    def classifier_artifact_paths(self) -> list[Path]:
        """The shipped artifact's candidates: ``asset_paths`` when ``classifier.artifact`` is
        written in the config, else only beside the config file (a config that names no artifact
        does not pick up the bundled one)."""
        if "artifact" in self.classifier.model_fields_set:
            return self.asset_paths(self.classifier.artifact)
        return [self.resolve_path(self.classifier.artifact).resolve()]

    def startup_problems(self) -> list[str]:
        """What would make this config fail its first requests, each naming the absolute path:
        a local model directory (of a model some tier uses) without config.json, and, when
        ``classifier.required``, no classifier artifact. Checked by `tiergate serve` and
        `tiergate worker` before they start."""
        problems = []
        used = dict.fromkeys(m for t in self.tiers.values() for m in (t.model, *t.fallbacks))
        for name in used:
            model = self.models[name]
            if model.provider == "local":
                paths = self.asset_paths(model.model)
                if not any((p / "config.json").is_file() or (p.suffix == ".gguf" and p.is_file()) for p in paths):
                    problems.append(f"models.{name}: no local model directory with a config.json (or .gguf file) "
                                    f"at {' or '.join(map(str, paths))}")
                if model.draft_model is not None:
                    drafts = self.asset_paths(model.draft_model)
                    if not any((p / "config.json").is_file() for p in drafts):
                        problems.append(f"models.{name}.draft_model: no model directory with a config.json at "
                                        f"{' or '.join(map(str, drafts))}")
        if self.classifier.required:
            paths = [self.resolve_path(self.classifier.feedback_dir).resolve() / CLASSIFIER_CURRENT_NAME,
                     *self.classifier_artifact_paths()]
            if not any(p.is_file() for p in paths):
                problems.append(f"classifier.artifact: no classifier artifact at {' or '.join(map(str, paths))} "
                                "(classifier.required is true; train one with `tiergate classifier train`, or set "
                                "required: false to route model 'auto' to routing.default_tier)")
        return problems


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(part) for part in e["loc"])
        lines.append(f"  {loc or '<root>'}: {e['msg']}")
    return "invalid config:\n" + "\n".join(lines)


def settings_from_dict(data: dict[str, Any], base_dir: str | Path = ".") -> Settings:
    try:
        return Settings.model_validate({**data, "base_dir": str(base_dir)})
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_settings(path: str | Path | None = None) -> Settings:
    """Load and validate config.yaml (``$TIERGATE_CONFIG`` or ./config.yaml)."""
    path = Path(path or os.environ.get(DEFAULT_CONFIG_ENV) or "config.yaml")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must be a mapping")
    return settings_from_dict(raw, base_dir=path.resolve().parent)
