"""Proxy routing evaluation on held-out source families, and the source → family grouping.

No model outputs are available offline, so the proxy derives synthetic strong-vs-cheap
outcomes from each graded family's own difficulty label: the strong model always succeeds;
the cheap model succeeds on the family's below-medium tiers (MATH Level 1, ARC-Easy,
LeetCode Easy, GSM8K ≤3 steps), half the time on medium, never on high/xhigh. Scored on
*out-of-fold* scores (the family was held out), APGR then measures whether the score ranks
prompts of an unseen kind by difficulty — the quantity a strong-vs-cheap router needs.
Families whose labels do not vary (one tier) are skipped: no router can matter there.

Must not import scikit-learn, torch, the gateway or the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from classifier.evaluate import apgr, routing_curve
from classifier.types import TIER_INDEX, LabelledExample

# Sources that are splits of one dataset: held out together so that one split's vocabulary
# cannot leak the other's label.
FAMILIES: dict[str, str] = {"arc_easy": "arc", "arc_challenge": "arc"}


def family(source: str) -> str:
    """The CV group of a source (the dataset it is a split of)."""
    return FAMILIES.get(source, source)


def cheap_outcome(tier: str) -> float:
    """Synthetic cheap-model success for a prompt of ``tier`` (the strong model scores 1)."""
    i = TIER_INDEX[tier]
    if i < TIER_INDEX["medium"]:
        return 1.0
    return 0.5 if i == TIER_INDEX["medium"] else 0.0


def proxy_apgr(examples: Sequence[LabelledExample], scores: np.ndarray, min_size: int = 20) -> dict[str, float]:
    """APGR per graded family of ``scores`` (held-out scores) against the synthetic outcomes."""
    fams = np.asarray([family(ex.source) for ex in examples])
    cheap = np.asarray([cheap_outcome(ex.tier) for ex in examples])
    out: dict[str, float] = {}
    for f in sorted(set(fams.tolist())):
        m = fams == f
        if m.sum() < min_size or len(np.unique(cheap[m])) < 2:
            continue
        out[f] = apgr(routing_curve(scores[m], cheap[m], np.ones(int(m.sum()))))
    return out


def proxy_oracle(examples: Sequence[LabelledExample]) -> dict[str, float]:
    """The proxy's ceiling: APGR per family of a router that knows the synthetic outcomes."""
    return proxy_apgr(examples, -np.asarray([cheap_outcome(ex.tier) for ex in examples]))
