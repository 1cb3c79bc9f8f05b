"""Multi-path execution with dynamic pruning (xhigh): N paths run one step in parallel, each
streamed with token logprobs. A path's running confidence is the mean logprob over a sliding
window of ``window`` tokens, sampled at every window boundary. Once a path has produced
``prune_after_tokens`` tokens, it is cancelled when its confidence has fallen at ``falls``
consecutive checkpoints and is below the best other surviving path's; the last survivor is
never cut. Cancelling closes the upstream stream, so the path stops generating.

Survivors are voted on (majority of the normalised last line, ties to the higher mean
logprob). Billing is not done here: the injected stream reports its attempt when it ends or
is closed (the router bills a cancelled path for the tokens it streamed before the cut).

Imports nothing from the gateway.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ConfidenceTracker:
    window: int
    logprobs: list[float] = field(default_factory=list)
    checkpoints: list[float] = field(default_factory=list)

    def add(self, logprob: float) -> None:
        self.logprobs.append(logprob)
        if len(self.logprobs) % self.window == 0:
            self.checkpoints.append(self.confidence)

    @property
    def confidence(self) -> float:
        recent = self.logprobs[-self.window:]
        return sum(recent) / len(recent) if recent else 0.0

    @property
    def mean_logprob(self) -> float:
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else float("-inf")

    def falling(self, falls: int) -> bool:
        """True when each of the last ``falls`` checkpoints is lower than the one before."""
        cps = self.checkpoints
        if len(cps) < falls + 1:
            return False
        recent = cps[-(falls + 1):]
        return all(b < a for a, b in itertools.pairwise(recent))


class PathPruner:
    def __init__(self, paths: int, prune_after_tokens: int, window: int | None = None, falls: int = 2) -> None:
        self.prune_after_tokens = prune_after_tokens
        self.window = window or max(4, prune_after_tokens // 4)
        self.falls = falls
        self.trackers = [ConfidenceTracker(self.window) for _ in range(paths)]
        self.pruned = [False] * paths

    def should_prune(self, i: int) -> bool:
        tracker = self.trackers[i]
        others = [j for j in range(len(self.trackers)) if j != i and not self.pruned[j]]
        if self.pruned[i] or not others or len(tracker.logprobs) < self.prune_after_tokens:
            return False
        if not tracker.falling(self.falls):
            return False
        best_other = max(self.trackers[j].confidence for j in others)
        if tracker.confidence < best_other:
            self.pruned[i] = True
            return True
        return False


@dataclass
class PathOutcome:
    index: int
    text: str
    tokens: int
    confidence: float
    mean_logprob: float
    pruned: bool


OpenStream = Callable[[int], Awaitable[AsyncIterator[dict[str, Any]]]]


async def _consume(i: int, open_stream: OpenStream, pruner: PathPruner) -> PathOutcome:
    tracker = pruner.trackers[i]
    parts: list[str] = []
    tokens, pruned = 0, False
    stream = await open_stream(i)
    try:
        async for chunk in stream:
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content") or ""
                parts.append(content)
                entries = ((choice.get("logprobs") or {}).get("content")) or []
                for entry in entries:
                    tracker.add(float(entry["logprob"]))
                tokens += len(entries) if entries else (1 if content else 0)
            if pruner.should_prune(i):
                pruned = True
                break
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()  # on a cut: cancels the upstream, which bills what it generated
    return PathOutcome(i, "".join(parts), tokens, tracker.confidence, tracker.mean_logprob, pruned)


async def run_paths(paths: int, open_stream: OpenStream, pruner: PathPruner) -> list[PathOutcome]:
    return list(await asyncio.gather(*(_consume(i, open_stream, pruner) for i in range(paths))))


def _answer_key(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return re.sub(r"[^a-z0-9.\-]+", " ", last.lower()).strip(" .-")


def vote(outcomes: list[PathOutcome]) -> PathOutcome:
    """The survivors' majority answer; ties broken by mean logprob."""
    survivors = [o for o in outcomes if not o.pruned] or outcomes
    counts = Counter(_answer_key(o.text) for o in survivors)
    return max(survivors, key=lambda o: (counts[_answer_key(o.text)], o.mean_logprob))
