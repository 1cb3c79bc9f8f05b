"""Tier thresholds from a target, calibrated on the scores of the traffic the router sees.

The score ranks prompts; the tier is the score's band, so the tier ordering *is* the score's
ranking (six single-tier bands, every tier reachable). The five cut points are quantiles of a
sliding window of recent scores (``ScoreWindow``), not of the training data, so the target
mix holds on the traffic actually served — a gateway whose traffic is all maths still sends
its hardest 10% to high/xhigh.

Targets (``RoutingTarget``):

- a *mix*: the share of traffic per tier (a partial mix such as ``{low: .7, medium: .2,
  high: .1}`` means bands none..low / medium / high..xhigh, each band's share split evenly over
  its tiers, so all six stay reachable);
- a *quality* target, "keep ≥ X of the all-strong quality": the least strong share whose
  routing curve (measured on outcomes) reaches PGR X, spread over the strong tiers in the mix's
  proportions;
- a *cost* target, "spend ≤ X of all-strong": the largest strong share whose expected cost
  (per-tier relative costs) stays within X.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from classifier.types import TIER_INDEX, TIERS, ClassifierError

# ~70% none..low, 20% medium, 10% high..xhigh (the design's typical mix), spread so that every
# tier carries traffic and the tier index keeps the score's ranking.
DEFAULT_TIER_MIX: dict[str, float] = {"none": 0.15, "minimal": 0.20, "low": 0.35, "medium": 0.20, "high": 0.07,
                                      "xhigh": 0.03}
STRONG_TIERS: tuple[str, ...] = ("high", "xhigh")


def full_mix(target_mix: Mapping[str, float]) -> tuple[float, ...]:
    """Six per-tier shares (summing to 1) from a full or partial mix.

    Each named tier closes a band that starts after the previous named tier (the last band runs
    to xhigh); a band's share is split evenly over its tiers, so every tier gets traffic."""
    if not target_mix:
        raise ClassifierError("target mix is empty")
    unknown = [t for t in target_mix if t not in TIER_INDEX]
    if unknown:
        raise ClassifierError(f"target mix names unknown tiers: {unknown}")
    if any(v < 0 for v in target_mix.values()) or sum(target_mix.values()) <= 0:
        raise ClassifierError("target mix shares must be non-negative and not all zero")
    named = sorted(target_mix, key=lambda t: TIER_INDEX[t])
    shares = [0.0] * len(TIERS)
    start = 0
    for i, t in enumerate(named):
        end = len(TIERS) if i == len(named) - 1 else TIER_INDEX[t] + 1
        for k in range(start, end):
            shares[k] = target_mix[t] / (end - start)
        start = end
    total = sum(shares)
    return tuple(s / total for s in shares)


def thresholds_from_scores(scores: Sequence[float] | np.ndarray, shares: Sequence[float]) -> tuple[float, ...]:
    """Five ascending cut points putting ``shares`` of ``scores`` into the six tiers (a score equal
    to a cut goes to the band above it; empty tiers get a cut just above the previous one)."""
    s = np.sort(np.asarray(scores, dtype=np.float64))
    if len(s) == 0:
        raise ClassifierError("cannot calibrate thresholds on no scores")
    cum = np.cumsum(np.asarray(shares, dtype=np.float64))[:-1] / float(np.sum(shares))
    pos = np.clip(np.round(cum * len(s)).astype(np.int64), 0, len(s))
    # the cut is the first score of the upper band: everything below it fills the lower bands
    cuts = np.where(pos < len(s), s[np.minimum(pos, len(s) - 1)], np.nextafter(s[-1], np.inf))
    cuts = np.maximum.accumulate(cuts)
    for i in range(1, len(cuts)):  # strictly ascending, so that searchsorted keeps tiers apart
        if cuts[i] <= cuts[i - 1]:
            cuts[i] = np.nextafter(cuts[i - 1], np.inf)
    return tuple(float(c) for c in cuts)


def tier_of(score: float, thresholds: Sequence[float]) -> str:
    """The tier whose band holds ``score``."""
    return TIERS[int(np.searchsorted(np.asarray(thresholds), score, side="right"))]


class ScoreWindow:
    """The last ``size`` decision scores, and thresholds re-derived from them every ``refresh``
    additions once ``min_count`` have been seen. Thread-safe; adding is O(1)."""

    def __init__(self, size: int = 4096, *, min_count: int = 256, refresh: int = 128) -> None:
        if size < 2 or min_count < 2 or refresh < 1:
            raise ClassifierError("score window needs size, min_count >= 2 and refresh >= 1")
        self.size = size
        self.min_count = min(min_count, size)
        self.refresh = refresh
        self._buf = np.zeros(size, dtype=np.float64)
        self._n = 0
        self._lock = threading.Lock()
        self._cache: dict[tuple[float, ...], tuple[int, tuple[float, ...]]] = {}

    def __len__(self) -> int:
        return min(self._n, self.size)

    @property
    def seen(self) -> int:
        return self._n

    def add(self, score: float) -> None:
        with self._lock:
            self._buf[self._n % self.size] = score
            self._n += 1

    def extend(self, scores: Sequence[float] | np.ndarray) -> None:
        for s in np.asarray(scores, dtype=np.float64).ravel():
            self.add(float(s))

    def scores(self) -> np.ndarray:
        with self._lock:
            return self._buf[:min(self._n, self.size)].copy()

    @property
    def warm(self) -> bool:
        return self._n >= self.min_count

    def thresholds(self, shares: Sequence[float]) -> tuple[float, ...] | None:
        """Cut points for ``shares`` on the window (None until ``min_count`` scores were seen);
        recomputed at most every ``refresh`` additions."""
        if not self.warm:
            return None
        key = tuple(float(x) for x in shares)
        hit = self._cache.get(key)
        if hit is not None and self._n - hit[0] < self.refresh:
            return hit[1]
        cuts = thresholds_from_scores(self.scores(), key)
        self._cache[key] = (self._n, cuts)
        return cuts


def strong_share_for_quality(shares: np.ndarray, pgr: np.ndarray, target: float) -> float:
    """Least strong-call share at which a routing curve's PGR reaches ``target`` (1.0 if never)."""
    hit = np.flatnonzero(np.asarray(pgr) >= target - 1e-12)
    if len(hit) == 0:
        return 1.0
    i = int(hit[0])
    if i == 0:
        return float(shares[0])
    x0, x1, y0, y1 = shares[i - 1], shares[i], pgr[i - 1], pgr[i]
    return float(x0 + (target - y0) / (y1 - y0) * (x1 - x0)) if y1 != y0 else float(x1)


def mix_with_strong_share(base: Sequence[float], strong_share: float,
                          strong: Sequence[str] = STRONG_TIERS) -> tuple[float, ...]:
    """``base`` rescaled so that the ``strong`` tiers hold ``strong_share`` of traffic in their
    base proportions and the other tiers the rest in theirs."""
    if not 0.0 <= strong_share <= 1.0:
        raise ClassifierError("strong share must be in [0, 1]")
    is_strong = np.asarray([t in strong for t in TIERS])
    b = np.asarray(base, dtype=np.float64) + 1e-9  # keep every tier reachable
    out = np.where(is_strong, strong_share * b / b[is_strong].sum(), (1 - strong_share) * b / b[~is_strong].sum())
    return tuple(float(x) for x in out / out.sum())


def strong_share_for_cost(base: Sequence[float], tier_costs: Mapping[str, float], budget: float,
                          strong: Sequence[str] = STRONG_TIERS) -> float:
    """The largest strong share whose expected cost per request stays within ``budget`` × the
    cost of sending everything to the most expensive strong tier (bisection; cost rises with it)."""
    costs = np.asarray([float(tier_costs[t]) for t in TIERS])
    ceiling = max(float(tier_costs[t]) for t in strong)

    def cost(q: float) -> float:
        return float(np.dot(mix_with_strong_share(base, q, strong), costs))

    if cost(0.0) > budget * ceiling:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(mid) <= budget * ceiling else (lo, mid)
    return lo


@dataclass(frozen=True)
class RoutingTarget:
    """What the thresholds aim at: a tier mix, or a quality or cost target that sets the strong share
    of that mix. ``quality_curve`` is (shares, PGR) of a routing curve measured on outcomes."""

    mix: Mapping[str, float]
    quality: float | None = None
    quality_curve: tuple[np.ndarray, np.ndarray] | None = None
    cost_budget: float | None = None
    tier_costs: Mapping[str, float] | None = None

    def shares(self) -> tuple[float, ...]:
        base = full_mix(self.mix)
        if self.quality is not None:
            if self.quality_curve is None:
                raise ClassifierError("a quality target needs a routing curve measured on outcomes")
            return mix_with_strong_share(base, strong_share_for_quality(*self.quality_curve, self.quality))
        if self.cost_budget is not None:
            if self.tier_costs is None:
                raise ClassifierError("a cost target needs per-tier costs")
            return mix_with_strong_share(base, strong_share_for_cost(base, self.tier_costs, self.cost_budget))
        return base
