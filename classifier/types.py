"""Plain data shared across the classifier: tier names, decisions, labelled examples, errors.

Must not import anything heavy (no scikit-learn, numpy only for type names) and nothing
from the gateway or the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TIERS: tuple[str, ...] = ("none", "minimal", "low", "medium", "high", "xhigh")
TIER_INDEX: dict[str, int] = {t: i for i, t in enumerate(TIERS)}

Message = Mapping[str, Any]
"""An OpenAI chat message: ``{"role": ..., "content": str | list[parts]}``."""


class ClassifierError(Exception):
    """Base class of every error the classifier library raises."""


class ArtifactError(ClassifierError):
    """An artifact is missing, tampered with, or was built for another version."""


class FeatureVersionError(ArtifactError):
    """Stored features were computed by an incompatible feature extractor."""


@dataclass(frozen=True)
class EffortDecision:
    """What the perceive layer decided for one request.

    ``score`` is the continuous difficulty in [0, 1]; ``probabilities`` are calibrated
    per-tier probabilities (they sum to 1); ``version`` names the artifact that decided.
    """

    tier: str
    score: float
    probabilities: dict[str, float]
    version: str


@dataclass(frozen=True)
class SparseFeatures:
    """A hashed feature vector: column indices, values and the feature version."""

    indices: tuple[int, ...]
    values: tuple[float, ...]
    feature_version: str

    def to_json(self) -> dict[str, Any]:
        return {"v": self.feature_version, "i": list(self.indices), "x": list(self.values)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SparseFeatures:
        try:
            return cls(tuple(int(i) for i in data["i"]), tuple(float(x) for x in data["x"]), str(data["v"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ClassifierError(f"malformed stored features: {err}") from None


@dataclass(frozen=True)
class LabelledExample:
    """One training example: either a conversation (``messages``) or stored features.

    ``tier`` is the label, ``score`` the continuous difficulty target in [0, 1],
    ``source`` the group used for grouped splits, ``weight`` the sample weight.
    """

    tier: str
    score: float
    source: str
    messages: Sequence[Message] | None = None
    features: SparseFeatures | None = None
    weight: float = 1.0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tier not in TIER_INDEX:
            raise ClassifierError(f"unknown tier {self.tier!r}; expected one of {', '.join(TIERS)}")
        if not 0.0 <= self.score <= 1.0:
            raise ClassifierError(f"score must be in [0, 1], got {self.score}")
        if self.messages is None and self.features is None:
            raise ClassifierError("a labelled example needs messages or stored features")


def user_prompt(text: str) -> list[Message]:
    """A single-turn conversation holding ``text`` as the user message."""
    return [{"role": "user", "content": text}]
