"""Online learning from revealed outcomes (the prequential evaluation and the feedback loop).

``OnlineRouter`` starts from a trained EffortModel's score and learns, one revealed
outcome at a time, a logistic correction over the same hashed features: its first
scores rank prompts exactly as the base model does, and every verdict nudges the
prompts that resemble it. Plain numpy SGD, so a step costs microseconds.

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from classifier.features import N_FEATURES, extract, to_arrays
from classifier.model import EffortModel
from classifier.types import Message, SparseFeatures


def _logit(p: float) -> float:
    p = min(max(p, 1e-12), 1 - 1e-12)  # only clip where float64 itself saturates: keep the base order
    return math.log(p / (1 - p))


class OnlineRouter:
    """Base score + an online logistic correction; ``score`` in [0, 1], higher = stronger tier."""

    def __init__(self, model: EffortModel, *, learning_rate: float = 0.05, l2: float = 1e-4) -> None:
        self.model = model
        self.learning_rate = learning_rate
        self.l2 = l2
        self.weights = np.zeros(N_FEATURES, dtype=np.float64)
        self.base_weight = 1.0
        self.bias = 0.0
        self.seen = 0

    def _z(self, features: SparseFeatures) -> tuple[float, float, np.ndarray, np.ndarray]:
        base = _logit(self.model.score_features(features))
        idx, val = to_arrays(features)
        return self.base_weight * base + self.bias + float(val @ self.weights[idx]), base, idx, val

    def score_features(self, features: SparseFeatures) -> float:
        z = self._z(features)[0]
        return 1.0 / (1.0 + math.exp(-max(min(z, 30.0), -30.0)))

    def score(self, messages: Sequence[Message]) -> float:
        return self.score_features(extract(messages))

    def learn_features(self, features: SparseFeatures, target: float) -> None:
        """One SGD step on log-loss towards ``target`` in [0, 1] (1 = the strong tier was needed)."""
        z, base, idx, val = self._z(features)
        p = 1.0 / (1.0 + math.exp(-max(min(z, 30.0), -30.0)))
        grad = p - min(max(target, 0.0), 1.0)
        lr = self.learning_rate
        self.weights[idx] -= lr * (grad * val + self.l2 * self.weights[idx])
        self.bias -= lr * grad
        self.base_weight -= lr * grad * base * 0.1
        self.seen += 1

    def learn(self, messages: Sequence[Message], target: float) -> None:
        self.learn_features(extract(messages), target)


def outcome_target(cheap: float, strong: float) -> float:
    """How much a prompt needed the strong model, in [0, 1] (0.5 = no difference)."""
    return (float(strong) - float(cheap) + 1.0) / 2.0
