"""Routing evaluation: a router is judged by how much of the strong model's quality it buys
per strong call.

Given per-prompt outcomes of a cheap and a strong model (booleans or scores in [0, 1])
and a router score (higher = send to the strong model), sweeping the threshold traces a
curve of strong-call share vs mean quality. Tied scores move together, so the curve is
piecewise linear and equals the expectation over random tie-breaking (a constant score
is exactly the random router). PGR(x) = (quality(x) − cheap) / (strong − cheap);
APGR = ∫₀¹ PGR(x) dx (random = 0.5; an inverted router scores 1 − APGR);
CPT(p) = the least strong-call share with PGR ≥ p.

Must not import torch, the gateway or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoutingCurve:
    shares: np.ndarray  # strong-call share at each threshold, 0 → 1
    quality: np.ndarray  # mean quality at that share
    cheap_quality: float
    strong_quality: float

    @property
    def gap(self) -> float:
        return self.strong_quality - self.cheap_quality

    def pgr(self) -> np.ndarray:
        if abs(self.gap) < 1e-12:
            return np.full_like(self.quality, np.nan)
        return (self.quality - self.cheap_quality) / self.gap


@dataclass(frozen=True)
class RoutingMetrics:
    apgr: float
    cpt50: float
    cpt80: float
    cheap_quality: float
    strong_quality: float


def routing_curve(scores: Sequence[float] | np.ndarray, cheap: Sequence[float] | np.ndarray,
                  strong: Sequence[float] | np.ndarray) -> RoutingCurve:
    """The threshold sweep: one point per distinct score, highest scores routed first."""
    s = np.asarray(scores, dtype=float)
    c = np.asarray(cheap, dtype=float)
    g = np.asarray(strong, dtype=float)
    n = len(s)
    if n == 0 or len(c) != n or len(g) != n:
        raise ValueError("scores, cheap and strong outcomes must be non-empty and the same length")
    order = np.argsort(-s, kind="stable")
    s, gain = s[order], (g - c)[order]
    # Close a group at the last index of each run of equal scores.
    ends = np.flatnonzero(np.r_[s[1:] != s[:-1], True]) + 1
    cum_gain = np.r_[0.0, np.cumsum(gain)[ends - 1]]
    shares = np.r_[0.0, ends / n]
    return RoutingCurve(shares=shares, quality=c.mean() + cum_gain / n, cheap_quality=float(c.mean()),
                        strong_quality=float(g.mean()))


def apgr(curve: RoutingCurve) -> float:
    """Area under PGR(share) on [0, 1] (trapezoids, exact for the piecewise-linear curve)."""
    p = curve.pgr()
    return float(np.sum((p[1:] + p[:-1]) / 2 * np.diff(curve.shares)))


def cpt(curve: RoutingCurve, target: float) -> float:
    """Least strong-call share at which PGR reaches ``target`` (linear between points)."""
    p = curve.pgr()
    if np.isnan(p).all():
        return float("nan")
    hit = np.flatnonzero(p >= target - 1e-12)
    if len(hit) == 0:
        return float("nan")
    i = int(hit[0])
    if i == 0:
        return 0.0
    x0, x1, y0, y1 = curve.shares[i - 1], curve.shares[i], p[i - 1], p[i]
    return float(x0 + (target - y0) / (y1 - y0) * (x1 - x0)) if y1 != y0 else float(x1)


def metrics(scores: Sequence[float] | np.ndarray, cheap: Sequence[float] | np.ndarray,
            strong: Sequence[float] | np.ndarray) -> RoutingMetrics:
    curve = routing_curve(scores, cheap, strong)
    return RoutingMetrics(apgr(curve), cpt(curve, 0.5), cpt(curve, 0.8), curve.cheap_quality,
                          curve.strong_quality)


def oracle_scores(cheap: Sequence[float] | np.ndarray, strong: Sequence[float] | np.ndarray) -> np.ndarray:
    """The oracle router's score: how much the strong model beats the cheap one on the prompt."""
    return np.asarray(strong, dtype=float) - np.asarray(cheap, dtype=float)


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float


def bootstrap(scores: Sequence[float] | np.ndarray, cheap: Sequence[float] | np.ndarray,
              strong: Sequence[float] | np.ndarray, *, n_boot: int = 200, seed: int = 0,
              alpha: float = 0.05) -> dict[str, Interval]:
    """Percentile bootstrap intervals for APGR, CPT(50%) and CPT(80%) (prompts resampled)."""
    s, c, g = (np.asarray(a, dtype=float) for a in (scores, cheap, strong))
    point = metrics(s, c, g)
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {"apgr": [], "cpt50": [], "cpt80": []}
    for _ in range(n_boot):
        i = rng.integers(0, len(s), len(s))
        m = metrics(s[i], c[i], g[i])
        draws["apgr"].append(m.apgr)
        draws["cpt50"].append(m.cpt50)
        draws["cpt80"].append(m.cpt80)

    def interval(name: str, est: float) -> Interval:
        d = np.asarray(draws[name])
        d = d[~np.isnan(d)]
        if len(d) == 0:
            return Interval(est, float("nan"), float("nan"))
        return Interval(est, float(np.quantile(d, alpha / 2)), float(np.quantile(d, 1 - alpha / 2)))

    return {"apgr": interval("apgr", point.apgr), "cpt50": interval("cpt50", point.cpt50),
            "cpt80": interval("cpt80", point.cpt80)}


def auroc(scores: Sequence[float] | np.ndarray, positive: Sequence[bool] | np.ndarray) -> float:
    """Area under the ROC curve (Mann–Whitney, ties count half); NaN without both classes."""
    s = np.asarray(scores, dtype=float)
    y = np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="stable")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    # average ranks over ties
    starts = np.r_[0, np.flatnonzero(sorted_s[1:] != sorted_s[:-1]) + 1]
    ends = np.r_[starts[1:], len(s)]
    for a, b in zip(starts, ends, strict=True):
        ranks[order[a:b]] = (a + b + 1) / 2
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def prequential(score_fn: Callable[[int], float], learn_fn: Callable[[int], None], n: int) -> np.ndarray:
    """Route-then-reveal: score prompt i with the current model, then let it learn from i."""
    out = np.empty(n)
    for i in range(n):
        out[i] = score_fn(i)
        learn_fn(i)
    return out
