"""The speculation controller: what a verify step costs, how often drafts are accepted, and how many tokens to
draft next.

- `SpecCosts`: measured costs (seconds per sequence): a plain decode step, a verify step *by draft length*, and
  drafting per proposer. A verify of ``k`` drafts runs ``k + 1`` rows; on a MoE each extra row may pull in
  experts the others did not use, so the cost is measured per ``k`` (and read off the measured points,
  rising with ``k``) rather than assumed to grow linearly.
- `Acceptance`: per draft position ``j``, how often the ``j``-th draft token was accepted when the ones before
  it were (counts that decay, so they follow a changing workload), kept per proposer and per *confidence
  bucket*: for prompt lookup the length of the n-gram it matched (a longer match predicts its continuation
  better), one bucket for the model drafters. The chance that a draft's first ``j`` tokens all pass follows.
- `best_draft`: the draft length with the largest expected net gain — expected tokens out of the verify minus
  what it and the drafting cost, in plain steps — and 0 (decode plainly) when no length gains.
- `SpecTotals` (counts for reports) and `SpecState` (one sequence: its proposer, its draft length while the
  engine has too little evidence to choose, its pauses).

Plain Python (no torch), testable with numbers; the engine's `engine.speculator` feeds and asks it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from itertools import pairwise

PROPOSERS = ("prompt_lookup", "draft", "self")
SETTLED = 3  # samples of a draft length before its median shapes the verify-cost curve
MODES = ("off", "auto", *PROPOSERS)


@dataclass(frozen=True)
class SpecConfig:
    """Engine-wide speculative-decoding settings.

    ``default``: the mode of requests that do not choose (``off``, ``auto`` = prompt lookup, or a proposer).
    Drafts are ``min_draft .. max_draft`` tokens. Until a proposer has ``probe_verifies`` verify steps across the
    engine, a sequence drafts ``initial_draft`` tokens, growing after a fully accepted draft and shrinking after
    a rejection; from then on the measured costs and acceptance choose (`best_draft`), every step. Prompt lookup
    proposes for free, so it simply does not draft where that does not pay (and drafts one token at one in
    ``engine_probe_every`` of those steps, to keep its estimate honest). A model drafter that does not pay pauses
    the sequence: for ``cooldown_tokens`` tokens (doubling each time, then a probe) while the proposer has fewer
    than ``engine_probe_verifies`` verify steps, to the end of the request after that. Once it has them and pays
    nowhere, new requests start with it off, except a probe after ``engine_probe_every`` of them (then after
    twice as many each time, see `engine.speculator`), which drafts once.
    """

    default: str = "off"
    initial_draft: int = 4
    engine_probe_verifies: int = 16
    engine_probe_every: int = 8
    min_draft: int = 1
    max_draft: int = 16
    ngram_max: int = 4
    ngram_min: int = 1
    probe_verifies: int = 8
    cooldown_tokens: int = 32

    def __post_init__(self) -> None:
        if self.default not in MODES:
            raise ValueError(f"speculative mode must be one of {MODES}, got {self.default!r}")
        if not 1 <= self.min_draft <= self.initial_draft <= self.max_draft:
            raise ValueError("need 1 <= min_draft <= initial_draft <= max_draft")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")


class _Recent:
    """The median of the last ``size`` samples: a step the machine delayed (another job took the core) moves it
    little, and it follows a lasting change within ``size / 2`` samples."""

    __slots__ = ("_median", "samples")

    def __init__(self, size: int = 16) -> None:
        self.samples: deque[float] = deque(maxlen=size)
        self._median: float | None = None

    def add(self, x: float) -> None:
        self.samples.append(x)
        self._median = None

    @property
    def count(self) -> int:
        return len(self.samples)

    @property
    def value(self) -> float:
        if self._median is None:
            self._median = statistics.median(self.samples)
        return self._median


@dataclass
class SpecCosts:
    """Measured step costs (seconds per sequence, each the median of recent samples), shared by the engine's
    sequences.

    ``plain``: a decode step without drafts. ``verify[k]``: a step verifying ``k`` drafts. ``draft_token``: a
    model drafter's proposing per draft token while it keeps up with the sequence; ``catch_up_token``: per token
    it had to run first (the prompt, or what was decoded while it paused); ``draft_call``: prompt lookup's per
    proposal (it does not grow with the draft). Until a model drafter's drafting is measured alone, a
    proposal that also caught up sets ``draft_token_bound``: its whole time per draft token, an upper bound that
    stands in for ``draft_token`` (``draft_token_cost``), so drafting that was never measured is never free. ``sums`` keeps totals for reports (`mean`)."""

    verify: dict[int, _Recent] = field(default_factory=dict)
    draft_token: dict[str, float] = field(default_factory=dict)
    draft_token_bound: dict[str, float] = field(default_factory=dict)
    catch_up_token: dict[str, float] = field(default_factory=dict)
    draft_call: dict[str, float] = field(default_factory=dict)
    sums: dict[str, list[float]] = field(default_factory=dict)  # key -> [count, total seconds]
    _plain: _Recent = field(default_factory=lambda: _Recent(32))
    _drafts: dict[str, _Recent] = field(default_factory=dict)
    _samples: int = 0  # plain and verify samples so far
    _plain_at: int = 0  # _samples at the latest plain sample
    _table: list[float] | None = None  # verify_costs' table, built at _table_at samples
    _table_at: int = 0
    table_version: int = 0  # verify_costs' rebuilds so far (a cached choice built on the table is stale after one)

    @property
    def plain(self) -> float | None:
        return self._plain.value if self._plain.count else None

    def _sum(self, key: str, seconds: float) -> None:
        acc = self.sums.setdefault(key, [0.0, 0.0])
        acc[0] += 1
        acc[1] += seconds

    def mean(self, key: str) -> float:
        """Mean over everything recorded under ``key`` (``plain``, ``verify``, ``verify:<k>``, ``draft:<proposer>``)."""
        n, total = self.sums.get(key, (0.0, 0.0))
        return total / n if n else math.nan

    def record_plain(self, seconds: float) -> None:
        before = self.plain
        self._plain.add(seconds)
        if self.plain != before:  # the curve starts at it: rebuilt on its next read
            self._table = None
        self._samples += 1
        self._plain_at = self._samples
        self._sum("plain", seconds)

    def record_verify(self, seconds: float, k: int) -> None:
        if k not in self.verify:
            self.verify[k] = _Recent()
            self._table = None
        self.verify[k].add(seconds)
        if self.verify[k].count == SETTLED:
            self._table = None
        self._samples += 1
        self._sum("verify", seconds)
        self._sum(f"verify:{k}", seconds)

    def record_draft(self, proposer: str, seconds: float, tokens: float) -> None:
        """One proposal of ``tokens`` draft tokens (per sequence) that took ``seconds``."""
        key = f"draft:{proposer}"
        self._sum(key, seconds)
        recent = self._drafts.setdefault(proposer, _Recent())
        if proposer == "prompt_lookup":
            recent.add(seconds)
            self.draft_call[proposer] = recent.value
        elif tokens > 0:
            recent.add(seconds / tokens)
            self.draft_token[proposer] = recent.value

    def record_draft_bound(self, proposer: str, seconds: float, tokens: float) -> None:
        """A proposal of ``tokens`` draft tokens that first caught up, ``seconds`` in all: drafting cost at most
        that per token (kept the lowest seen; ``draft_token``, once measured, takes precedence)."""
        if tokens > 0:
            bound = seconds / tokens
            self.draft_token_bound[proposer] = min(bound, self.draft_token_bound.get(proposer, bound))

    def draft_token_cost(self, proposer: str) -> float:
        """A model drafter's cost per draft token: measured, else its upper bound, else 0 (nothing proposed yet)."""
        measured = self.draft_token.get(proposer)
        return measured if measured is not None else self.draft_token_bound.get(proposer, 0.0)

    def record_catch_up(self, proposer: str, seconds: float, tokens: int) -> None:
        """A model drafter ran ``tokens`` of a sequence before drafting, in ``seconds`` beyond its drafting."""
        self._sum(f"catch-up:{proposer}", seconds)
        recent = self._drafts.setdefault(f"catch-up:{proposer}", _Recent())
        recent.add(seconds / tokens)
        self.catch_up_token[proposer] = recent.value

    def needs_plain(self, every: int = 64) -> bool:
        """Whether the next step should be plain to keep the plain step's cost current (every choice is
        against it): fewer than 3 plain samples, ``every`` samples since the last, or sooner (every 4) while a
        settled verify step is measured cheaper than the plain one, which cannot be: a verify does a plain
        step's work and more, so the plain estimate is stale (samples taken while the machine or the first use
        of a drafter delayed the step)."""
        since = self._samples - self._plain_at
        return self._plain.count < 3 or since >= every or (since >= 4 and self._plain_too_high())

    def plain_step(self) -> float | None:
        """The plain step's cost as choices read it: the cost curve's start (never above a settled verify),
        else the plain estimate alone."""
        table = self.verify_costs(1)
        return table[0] if table else self.plain

    def _plain_too_high(self) -> bool:
        plain = self.plain
        return plain is not None and any(r.count >= SETTLED and r.value < plain for r in self.verify.values())

    def verify_costs(self, k_max: int) -> list[float] | None:
        """Verify steps of 0..k_max drafts (0: the plain step): the measured points, never falling as ``k``
        grows, interpolated between them and extended past the longest measured draft at its last slope; None
        until a plain and a verify step are measured. Lengths with fewer than ``SETTLED`` samples are left out
        while any length has that many (a single step the machine delayed would otherwise bend the curve).
        Rebuilt after every 8 new samples, or when a draft length is first measured or settles
        (``table_version`` counts the rebuilds)."""
        if self.plain is None or not self.verify:
            return None
        if self._table is None or len(self._table) <= k_max or self._samples - self._table_at >= 8:
            lengths = sorted(self.verify)
            settled = [n for n in lengths if self.verify[n].count >= SETTLED]
            # the plain step costs at most a settled verify (see needs_plain): a higher estimate would lift the
            # whole curve to it and make drafting look free (self-speculation drafted ~7 tokens at 0.39x)
            points = [(0, min([self.plain] + [self.verify[n].value for n in settled]))]
            for n in settled or lengths:  # a length tried once or twice is one noisy sample: read off the others
                points.append((n, max(self.verify[n].value, points[-1][1])))
            top = max(k_max, 2 * points[-1][0])
            table = []
            it = iter(pairwise(points))
            (k0, c0), (k1, c1) = next(it)
            for k in range(top + 1):
                while k > k1 and k1 < points[-1][0]:
                    (k0, c0), (k1, c1) = next(it)
                table.append(c0 + (c1 - c0) * (k - k0) / (k1 - k0))
            self._table, self._table_at = table, self._samples
            self.table_version += 1
        return self._table[:k_max + 1]

    def verify_cost(self, k: int) -> float | None:
        """A verify step of ``k`` drafts (see `verify_costs`)."""
        table = self.verify_costs(k)
        return None if table is None else table[k]

    def step_cost(self, proposer: str, k: int) -> float | None:
        """Verifying ``k`` drafts plus proposing them (prompt lookup's proposal is paid whether it drafts or not,
        so it is left out)."""
        verify = self.verify_cost(k)
        if verify is None:
            return None
        return verify + k * self.draft_token_cost(proposer)


class Acceptance:
    """Per draft position ``j`` (1-based): accepted / tried, where a try is the ``j``-th draft token of a
    draft whose first ``j - 1`` tokens were accepted. Counts are scaled down once a position has ``cap``
    tries, so old evidence fades. A position with little evidence leans on the one before it."""

    def __init__(self, max_draft: int, cap: float = 64.0) -> None:
        self.hits = [0.0] * (max_draft + 1)
        self.tries = [0.0] * (max_draft + 1)
        self.cap = cap
        self.version = 0  # records so far (a cached choice built on these counts is stale after one)
        # best_draft's answers: (costs id, proposer, k_max) -> (the costs, what they were built on, the answer)
        self.cached: dict[tuple[int, str, int], tuple[SpecCosts, tuple[int, int, float], tuple[int, float]]] = {}

    def record(self, drafted: int, accepted: int) -> None:
        self.version += 1
        for j in range(1, min(accepted + (accepted < drafted), drafted) + 1):
            if j >= len(self.tries):
                break
            self.tries[j] += 1
            self.hits[j] += j <= accepted
            if self.tries[j] > self.cap:
                scale = self.cap / self.tries[j]
                self.tries[j] *= scale
                self.hits[j] *= scale

    @property
    def evidence(self) -> float:
        return self.tries[1]

    def survival(self, k: int) -> list[float]:
        """P(the first j draft tokens are all accepted) for j = 1..k."""
        out: list[float] = []
        alive, prior = 1.0, 0.5
        for j in range(1, k + 1):
            if j < len(self.tries):
                prior = (self.hits[j] + 2 * prior) / (self.tries[j] + 2)
            alive *= prior
            out.append(alive)
        return out


def best_draft(costs: SpecCosts, proposer: str, acceptance: Acceptance, k_max: int) -> tuple[int, float] | None:
    """The draft length (0..k_max) with the largest expected net gain in plain steps — expected tokens out of
    the verify (``1 + sum_j P(first j accepted)``) minus its cost over a plain step's — and that gain (0 for
    decoding plainly); None while the costs are unmeasured. The answer is kept until the acceptance, the cost
    table or the drafting cost change (asked every step, it mostly does not)."""
    table = costs.verify_costs(k_max)
    if table is None or table[0] <= 0:
        return None
    plain, per_token = table[0], costs.draft_token_cost(proposer)
    key, state = (id(costs), proposer, k_max), (acceptance.version, costs.table_version, per_token)
    cached = acceptance.cached.get(key)
    if cached is not None and cached[0] is costs and cached[1] == state:
        return cached[2]
    best, best_gain = 0, 0.0
    tokens = 1.0
    for k, alive in enumerate(acceptance.survival(k_max), start=1):
        tokens += alive
        gain = tokens - (table[k] + k * per_token) / plain
        if gain > best_gain:
            best, best_gain = k, gain
    if len(acceptance.cached) > 64:
        acceptance.cached.clear()
    acceptance.cached[key] = (costs, state, (best, best_gain))
    return best, best_gain


@dataclass
class SpecTotals:
    """Engine-wide counts per proposer (for reports and benchmarks)."""

    verifies: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # verify steps that rejected a draft token
    emitted: int = 0  # tokens out of verify steps (accepted drafts + one each)
    no_guess: int = 0  # decode steps at which the proposer had nothing to propose (prompt lookup found no match)
    declined: int = 0  # decode steps at which it had a guess but drafting was predicted not to pay
    skipped: int = 0  # requests started with speculation off because it did not pay engine-wide
    next_probe: int = 0  # the skipped count at which the next such request probes instead (0: engine_probe_every)
    probe_gap: int = 0  # skipped requests between probes (0: none yet)
    positions: Acceptance = field(default_factory=lambda: Acceptance(64, cap=math.inf))  # every verify, kept

    @property
    def guess_share(self) -> float:
        """Of the decode steps where this proposer was asked, the share it had a guess for."""
        asked = self.verifies + self.declined + self.no_guess
        return (self.verifies + self.declined) / asked if asked else math.nan

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def tokens_per_verify(self) -> float:
        return self.emitted / self.verifies if self.verifies else math.nan


@dataclass
class SpecState:
    """One sequence's speculation: its proposer, the draft length it uses while the engine has too little
    evidence to choose (grows by 2 after a fully accepted draft, shrinks to just past a rejection), the
    confidence bucket of its pending draft, and its pauses."""

    proposer: str
    k: int
    bucket: int = 0
    verifies: int = 0
    drafted: int = 0
    accepted: int = 0
    paused_until: int = 0  # output-token count before which speculation is off
    pauses: int = 0
    probing: bool = False  # back from a pause: the next draft is a probe at the heuristic length

    def active(self, num_output_tokens: int) -> bool:
        return num_output_tokens >= self.paused_until

    def record(self, drafted: int, accepted: int, config: SpecConfig) -> None:
        self.verifies += 1
        self.drafted += drafted
        self.accepted += accepted
        self.k = min(config.max_draft, self.k + 2) if accepted == drafted else max(config.min_draft, accepted + 1)

    def pause(self, num_output_tokens: int, config: SpecConfig) -> None:
        """Stop drafting for ``cooldown_tokens`` tokens, doubling with each pause (up to 16 times as long)."""
        self.pauses += 1
        self.probing = True
        self.paused_until = num_output_tokens + config.cooldown_tokens * (1 << min(self.pauses - 1, 4))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else math.nan
