"""``tiergate bench pipeline --outcomes FILE``: the saving shown at a quality level, not alone.

The prompts of an outcomes file (per-prompt results of arms — tiers — run on them, e.g.
``bbh_direct_vs_cot.jsonl``: direct = low, chain-of-thought = high) are replayed through the
gateway's classifier, routing and pipeline cost model (``gateway.bench.pipeline.replay``); each
prompt's expected quality is the outcome of the arm nearest to the tier it was routed to (at or
below it when there is one). Printed beside the cost: routed vs all-high vs all-low, the share of
the all-high quality kept, and the share of its cost spent.

Imports the classifier's outcome loader and the pipeline bench; no web framework.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import classifier
from gateway.bench.pipeline import load_decider, replay
from gateway.bench.workload import WorkItem
from gateway.money import format_usd
from gateway.settings import TIER_NAMES, Settings


def arm_quality(outcomes: dict[str, float], tier: str) -> float:
    """The outcome of the arm nearest to ``tier``, preferring the ones at or below it."""
    rank = TIER_NAMES.index(tier)
    arms = sorted((a for a in outcomes if a in TIER_NAMES), key=TIER_NAMES.index)
    below = [a for a in arms if TIER_NAMES.index(a) <= rank]
    return float(outcomes[below[-1] if below else arms[0]])


def _last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    return next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")


def run_quality(path: Path, n: int, seed: int, settings: Settings | None) -> str:
    items = [it for it in classifier.load_outcome_items(path) if it.has("low", "high")]
    rng = random.Random(seed)
    rng.shuffle(items)
    items = items[:n]
    decide, decided_by = load_decider(settings)
    work = [WorkItem("outcomes", "medium", "low", _last_user_text(it.messages)) for it in items]
    totals = asyncio.run(replay(work, decide, seed))
    routed_q = sum(arm_quality(dict(it.outcomes), t) for it, t in zip(items, totals.efforts, strict=True)) / len(items)
    high_q = sum(it.outcomes["high"] for it in items) / len(items)
    low_q = sum(it.outcomes["low"] for it in items) / len(items)
    return "\n".join([
        f"tiergate bench pipeline --outcomes {path}: {len(items)} prompts with low and high outcomes, seed {seed}",
        f"effort decided by: {decided_by or 'FALLBACK: the default tier'}",
        "cost: the pipeline bench's simulated upstreams (every prompt priced as a medium-difficulty request); "
        "quality: each prompt's outcome of the arm nearest to its routed tier (at or below it)",
        "effort mix: " + ", ".join(f"{t} {totals.effort[t] / len(items):.1%}" for t in TIER_NAMES),
        f"routed:   quality {routed_q:.3f}  cost ${format_usd(totals.routed, 4)}",
        f"all-high: quality {high_q:.3f}  cost ${format_usd(totals.all_high, 4)}",
        f"all-low:  quality {low_q:.3f}  cost ${format_usd(totals.all_low, 4)}",
        f"routed keeps {routed_q / high_q:.1%} of the all-high quality at {totals.routed / totals.all_high:.1%} of "
        f"its cost (quality gap closed vs all-low: "
        f"{(routed_q - low_q) / (high_q - low_q) if high_q != low_q else float('nan'):.1%})",
    ])
