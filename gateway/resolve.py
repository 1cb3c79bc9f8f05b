"""Which tier (or model) answers a request: the requested ``model`` name → a ``Resolution``.

- a tier name (``low``) or ``tier-<name>`` → that tier, its model and ordered fallbacks;
- a model configured under ``models:`` → that model directly (tier = the first tier that uses
  it, else ``direct``);
- ``auto`` → the client's ``reasoning_effort`` if given, else the ``decide_auto`` hook (the
  classifier's ``Perceiver``, plugged in by create_app), else the configured default tier.

Pure policy: imports settings and errors only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import ModelNotFound
from gateway.settings import TIER_NAMES, Settings

AUTO_MODEL = "auto"
TIER_PREFIX = "tier-"
DIRECT_TIER = "direct"
DEFAULT_AUTO_TIER = "low"


class EffortDecisionLike(Protocol):
    """What the classifier returns (``gateway.perceive.EffortDecision``)."""

    @property
    def tier(self) -> str: ...
    @property
    def score(self) -> float: ...
    @property
    def version(self) -> str: ...


DecideAuto = Callable[[list[dict[str, Any]]], EffortDecisionLike]


@dataclass(frozen=True)
class Resolution:
    requested_model: str
    tier: str  # a tier name, or "direct" for a model no tier uses
    models: tuple[str, ...]  # ordered chain: primary model, then fallbacks
    effort_source: str  # client | classifier | default
    classifier_score: float | None = None
    classifier_version: str | None = None
    by_model: bool = False  # the client named a configured model: its own price and output cap apply

    def price_tier(self, settings: Settings) -> str | None:
        """The tier whose prices bill this request's calls; None: each model's own price."""
        return None if self.by_model or self.tier not in settings.tiers else self.tier


def public_model_names(settings: Settings) -> list[str]:
    """Everything a client may put in ``model``: auto, one name per tier, every configured model."""
    return [AUTO_MODEL, *(TIER_PREFIX + t for t in TIER_NAMES), *settings.models]


def _tier_resolution(settings: Settings, requested: str, tier: str, source: str,
                     score: float | None = None, version: str | None = None) -> Resolution:
    t = settings.tiers[tier]  # type: ignore[index]
    return Resolution(requested, tier, (t.model, *t.fallbacks), source, score, version)


def tier_for_model(settings: Settings, model_name: str) -> str:
    for name in TIER_NAMES:
        if settings.tiers[name].model == model_name:  # type: ignore[index]
            return name
    return DIRECT_TIER


def resolve_model(settings: Settings, requested: str, messages: list[dict[str, Any]], *,
                  reasoning_effort: str | None = None, decide_auto: DecideAuto | None = None,
                  default_tier: str = DEFAULT_AUTO_TIER) -> Resolution:
    if requested in TIER_NAMES:
        return _tier_resolution(settings, requested, requested, "client")
    if requested.startswith(TIER_PREFIX) and requested[len(TIER_PREFIX):] in TIER_NAMES:
        return _tier_resolution(settings, requested, requested[len(TIER_PREFIX):], "client")
    if requested in settings.models:
        return Resolution(requested, tier_for_model(settings, requested), (requested,), "client", by_model=True)
    if requested == AUTO_MODEL:
        if reasoning_effort in TIER_NAMES:
            return _tier_resolution(settings, requested, reasoning_effort, "client")  # type: ignore[arg-type]
        if decide_auto is not None:
            decision = decide_auto(messages)
            return _tier_resolution(settings, requested, decision.tier, "classifier",
                                    float(decision.score), decision.version)
        return _tier_resolution(settings, requested, default_tier, "default")
    raise ModelNotFound(f"The model '{requested[:100]}' does not exist or you do not have access to it.",
                        param="model")


def output_cap(settings: Settings, resolution: Resolution) -> int | None:
    """The most one choice may generate: the tier's ``max_output_tokens``, or for a model called by
    its own name that model's ``max_output_tokens`` (None: the upstream's own limit)."""
    if resolution.by_model or resolution.tier not in settings.tiers:
        return settings.models[resolution.models[0]].max_output_tokens
    return settings.tiers[resolution.tier].max_output_tokens  # type: ignore[index]


def cap_output(body: dict[str, Any], cap: int | None) -> None:
    """Bound ``body``'s output-token field by ``cap`` in place; one field is forwarded
    (``max_completion_tokens`` when the client used it, else ``max_tokens``)."""
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if cap is None and asked is None:
        return
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    body.pop("max_tokens", None)
    body.pop("max_completion_tokens", None)
    body[key] = asked if cap is None else min(asked, cap) if asked is not None else cap
