"""The settings' common parts: the strict base model, the tier names, the config error."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

TIER_NAMES: tuple[str, ...] = ("none", "minimal", "low", "medium", "high", "xhigh")
Tier = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
DEFAULT_CONFIG_ENV = "TIERGATE_CONFIG"


class ConfigError(Exception):
    """config.yaml is missing, malformed or names an invalid field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
