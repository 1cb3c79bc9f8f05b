"""Evaluating the classifier as a router on an outcomes file: the classifier's score, the
prequential (route-then-learn, full information, in a seeded shuffle) variant, and the random and
oracle baselines, each with APGR / CPT(50%) / CPT(80%) and bootstrap intervals. The fuller
benchmark (tier rows, length, held-out groups, partial-feedback replay) is classifier.routing_bench.

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from classifier.evaluate import (
    Interval,
    RoutingCurve,
    RoutingMetrics,
    bootstrap,
    metrics,
    oracle_scores,
    prequential,
    routing_curve,
)
from classifier.features import extract
from classifier.model import EffortModel
from classifier.online import OnlineRouter, outcome_target
from classifier.outcomes import Outcome


@dataclass(frozen=True)
class RouterEval:
    name: str
    metrics: RoutingMetrics
    intervals: dict[str, Interval]
    curve: RoutingCurve


def quality_at(curve: RoutingCurve, share: float) -> float:
    """Mean quality at a strong-call share (the curve is piecewise linear)."""
    return float(np.interp(share, curve.shares, curve.quality))


def _eval(name: str, scores: np.ndarray, cheap: np.ndarray, strong: np.ndarray, n_boot: int,
          seed: int) -> RouterEval:
    return RouterEval(name, metrics(scores, cheap, strong),
                      bootstrap(scores, cheap, strong, n_boot=n_boot, seed=seed) if n_boot > 0 else {},
                      routing_curve(scores, cheap, strong))


def evaluate_routers(model: EffortModel, outcomes: Sequence[Outcome], *, n_boot: int = 200, seed: int = 0,
                     with_prequential: bool = False, learning_rate: float = 0.05) -> list[RouterEval]:
    """The classifier (and optionally its prequential variant) next to random and oracle."""
    cheap = np.asarray([o.cheap for o in outcomes])
    strong = np.asarray([o.strong for o in outcomes])
    feats = [extract(o.messages) for o in outcomes]
    results = [_eval("classifier", np.asarray([model.score_features(f) for f in feats]), cheap, strong,
                     n_boot, seed)]
    if with_prequential:
        # Honest order: the file's order may be sorted (by subject, by difficulty), which flatters a
        # learner that sees similar prompts in a row; route in a seeded shuffle instead.
        order = np.random.default_rng(seed).permutation(len(feats))
        router = OnlineRouter(model, learning_rate=learning_rate)
        shuffled = prequential(lambda k: router.score_features(feats[order[k]]),
                               lambda k: router.learn_features(feats[order[k]],
                                                               outcome_target(cheap[order[k]], strong[order[k]])),
                               len(feats))
        scores = np.empty(len(feats))
        scores[order] = shuffled
        results.append(_eval("prequential", scores, cheap, strong, n_boot, seed))
    results.append(_eval("random", np.zeros(len(feats)), cheap, strong, n_boot, seed))
    results.append(_eval("oracle", oracle_scores(cheap, strong), cheap, strong, n_boot, seed))
    return results
