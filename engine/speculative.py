"""Exact speculative decoding: the verify rule, the prompt-lookup proposer, and the per-sequence controller.

A *proposer* guesses the next ``k`` tokens of a sequence cheaply; the target model then runs the sequence's
last known token and the ``k`` guesses in one step (the runner returns ``k + 1`` rows of logits) and `verify`
keeps what the target would have produced itself:

- greedy: accept draft tokens while each equals the target's argmax at its position, then emit the target's
  own argmax at the first mismatch (or after the last draft: the *bonus* token). The output is token for token
  that of plain greedy decoding.
- sampled: standard rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Draft token ``x`` drawn
  from the draft's distribution ``q`` is accepted with probability ``min(1, p(x) / q(x))``; on rejection the
  token comes from the residual ``max(p - q, 0)`` renormalised; after ``k`` acceptances a bonus token is drawn
  from ``p``. Each emitted token is distributed exactly as plain sampling from ``p`` would be. A deterministic
  proposer (prompt lookup) has a one-hot ``q``.

``p`` is the same distribution plain sampling draws from: temperature, top-k and top-p applied by
`engine.sampling`, with end-of-sequence ids suppressed where ``min_tokens`` asks.

The per-sequence controller (`SpecState`) picks the draft length that the measured costs (`SpecCosts`: plain
step, verify step, drafting, timed by the engine) and the sequence's acceptance rate predict to be fastest,
and switches speculation off for a while when even that is slower than plain decoding, so a sequence the
proposer cannot predict decodes at plain speed.

`ModelDrafter` runs a draft model (or the target at fewer experts) through the runner's `run_spans` over its
own paged cache.

Imports torch, engine.sampling, engine.blocks and engine.runner; never the model code, the scheduler's policy,
or anything web/db.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from engine.blocks import BlockAllocator
from engine.runner import DecodeBackend, KVCache, Span, run_spans
from engine.sampling import filter_top_k_top_p
from engine.sampling_params import SamplingParams

PROPOSERS = ("prompt_lookup", "draft", "self")
DECODE_ROWS_MAX = 16  # a drafter's catch-up of at most this many tokens runs as decode rows (see `Span`)
MODES = ("off", "auto", *PROPOSERS)


@dataclass(frozen=True)
class SpecConfig:
    """Engine-wide speculative-decoding settings.

    ``default``: the mode of requests that do not choose (``off``, ``auto`` = prompt lookup, or a proposer).
    Draft length starts at ``initial_draft`` and adapts within ``min_draft .. max_draft``. A sequence is judged
    after ``probe_verifies`` verify steps; when its predicted gain falls below 1, speculation pauses for
    ``cooldown_tokens`` tokens (doubling each time), then probes again. Once a proposer has
    ``engine_probe_verifies`` verify steps across the engine and its predicted gain there is below 1, new
    requests start with it off, except one in ``engine_probe_every`` (which keeps the evidence fresh).
    """

    default: str = "off"
    initial_draft: int = 4
    engine_probe_verifies: int = 32  # engine-wide evidence before new requests may start with speculation off
    engine_probe_every: int = 8  # while it does not pay engine-wide, one request in this many still probes
    min_draft: int = 1
    max_draft: int = 8
    ngram_max: int = 3
    ngram_min: int = 1
    probe_verifies: int = 4
    cooldown_tokens: int = 32
    ema: float = 0.3

    def __post_init__(self) -> None:
        if self.default not in MODES:
            raise ValueError(f"speculative mode must be one of {MODES}, got {self.default!r}")
        if not 1 <= self.min_draft <= self.initial_draft <= self.max_draft:
            raise ValueError("need 1 <= min_draft <= initial_draft <= max_draft")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")


# -- verification ---------------------------------------------------------------------------------
def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [R, V] -> the distribution plain sampling draws from, per row (float32)."""
    rows = [torch.softmax(filter_top_k_top_p(row / params.temperature, params.top_k, params.top_p), dim=-1)
            for row in logits.float()]
    return torch.stack(rows)


def verify(logits: torch.Tensor, draft: Seq[int], params: SamplingParams,
           generator: torch.Generator | None = None, draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens the target emits after checking ``draft``: the accepted leading drafts plus one token.

    logits: [k + 1, V], the target's logits at the last known token and after each draft token (suppressed
    ids already at -inf). draft: k token ids. draft_probs: [k, V], the distributions the drafts were drawn
    from, or None for a deterministic proposer. Returns between 1 and k + 1 tokens; the first
    ``len(result) - 1`` are ``draft[:len(result) - 1]``.
    """
    k = len(draft)
    if logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} rows of logits for {k} draft tokens, got {logits.shape[0]}")
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        n = 0
        while n < k and draft[n] == best[n]:
            n += 1
        return [*draft[:n], best[n]]
    p = target_probs(logits, params)
    out: list[int] = []
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qx = 1.0 if draft_probs is None else float(draft_probs[i, x])
        u = float(torch.rand((), generator=generator))
        if qx > 0 and u * qx < px:  # u < p/q, without dividing
            out.append(x)
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - draft_probs[i].float()).clamp_min(0.0)
        total = float(residual.sum())
        row = residual / total if total > 0 else p[i]
        out.append(int(torch.multinomial(row, 1, generator=generator).item()))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator).item()))
    return out


# -- prompt lookup --------------------------------------------------------------------------------
def prompt_lookup(tokens: Seq[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the sequence's last n-gram.

    The longest match wins (up to ``ngram_max`` tokens, at least ``ngram_min``), the latest among equals;
    [] when nothing matches. Pure Python, scanning with ``list.index`` (C speed): the proposer of choice for
    copy-heavy answers (rewrites, edits, quotes) at no model cost.
    """
    seq = tokens if isinstance(tokens, list) else list(tokens)
    end = len(seq) - 1  # candidates end strictly before the last token
    if end < 1 or k < 1:
        return []
    last = seq[end]
    best_len, best_at = 0, -1
    i = -1
    while True:
        try:
            i = seq.index(last, i + 1, end)
        except ValueError:
            break
        n = 1
        while n < ngram_max and i - n >= 0 and seq[i - n] == seq[end - n]:
            n += 1
        if n >= best_len:  # later occurrences win ties
            best_len, best_at = n, i
    if best_len < ngram_min or best_at < 0:
        return []
    return seq[best_at + 1:best_at + 1 + k]


# -- the controller -------------------------------------------------------------------------------
@dataclass
class SpecCosts:
    """Measured step costs (seconds, exponential moving averages) shared by the engine's sequences.

    ``plain``: a step without drafts, per sequence in it. ``verify``: a step with drafts, per sequence in it,
    at a mean draft length ``verify_k``. ``draft_token[proposer]``: proposing, per draft token. From these,
    `gain` predicts the speed of drafting ``k`` tokens at per-token acceptance ``alpha`` relative to plain
    decoding (a verify step's cost grows linearly in ``k`` between the plain step and the measured one).
    """

    ema: float = 0.3
    plain: float | None = None
    verify: float | None = None
    verify_k: float | None = None
    draft_token: dict[str, float] = field(default_factory=dict)
    sums: dict[str, list[float]] = field(default_factory=dict)  # key -> [count, total seconds], for reports

    def _mix(self, old: float | None, new: float, key: str | None = None) -> float:
        if key is not None:
            acc = self.sums.setdefault(key, [0.0, 0.0])
            acc[0] += 1
            acc[1] += new
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def mean(self, key: str) -> float:
        """Mean over everything recorded under ``key`` (``plain``, ``verify`` or ``draft:<proposer>``)."""
        n, total = self.sums.get(key, (0.0, 0.0))
        return total / n if n else math.nan

    def record_plain(self, seconds_per_seq: float) -> None:
        self.plain = self._mix(self.plain, seconds_per_seq, "plain")

    def record_verify(self, seconds_per_seq: float, draft_len: float) -> None:
        self.verify = self._mix(self.verify, seconds_per_seq, "verify")
        self.verify_k = self._mix(self.verify_k, draft_len)

    def record_draft(self, proposer: str, seconds_per_seq: float, tokens_per_seq: float) -> None:
        self._mix(None, seconds_per_seq, f"draft:{proposer}")
        if tokens_per_seq > 0:
            self.draft_token[proposer] = self._mix(self.draft_token.get(proposer), seconds_per_seq / tokens_per_seq)

    def gain(self, proposer: str, alpha: float, k: int) -> float | None:
        """Predicted tokens/s of drafting ``k`` at acceptance ``alpha``, as a multiple of plain decoding; None
        until a plain and a verify step have been measured."""
        if self.plain is None or self.verify is None or self.verify_k is None or self.plain <= 0:
            return None
        per_row = max(self.verify - self.plain, 0.0) / max(self.verify_k, 1.0)
        cost = self.plain + per_row * k + self.draft_token.get(proposer, 0.0) * k
        tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
        return tokens * self.plain / cost

    def best_k(self, proposer: str, alpha: float, k_min: int, k_max: int) -> tuple[int, float] | None:
        """The draft length with the best predicted `gain`, and that gain (None while unmeasured)."""
        best: tuple[int, float] | None = None
        for k in range(k_min, k_max + 1):
            g = self.gain(proposer, alpha, k)
            if g is None:
                return None
            if best is None or g > best[1]:
                best = (k, g)
        return best


@dataclass
class SpecTotals:
    """Engine-wide counts per proposer (for reports and benchmarks)."""

    verifies: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # verify steps that rejected a draft token
    emitted: int = 0  # tokens out of verify steps (accepted drafts + one each)
    skipped: int = 0  # requests started with speculation off because it did not pay engine-wide

    @property
    def alpha(self) -> float:
        """Per-token acceptance (accepted over accepted plus rejections), the geometric model's rate."""
        return self.accepted / (self.accepted + self.rejections) if self.accepted + self.rejections else math.nan

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def tokens_per_verify(self) -> float:
        return self.emitted / self.verifies if self.verifies else math.nan


@dataclass
class SpecState:
    """One sequence's speculation: its proposer, current draft length and acceptance record.

    Acceptance is tracked as a per-token rate ``alpha`` (accepted drafts over accepted drafts plus
    rejections, exponentially weighted), the geometric model behind the expected tokens of a draft. Once
    costs are measured, the draft length is the one with the best predicted gain; when even that gain is
    below 1 (after ``probe_verifies`` verify steps) speculation pauses, for longer each time. Before costs are
    measured, the length grows by 2 after a fully accepted draft and shrinks to just past a rejection.
    """

    proposer: str
    k: int
    verifies: int = 0
    drafted: int = 0
    accepted: int = 0
    successes: float = 0.0  # EMA counts behind alpha
    failures: float = 0.0
    paused_until: int = 0  # output-token count before which speculation is off
    pauses: int = 0
    last_gain: float | None = None

    def active(self, num_output_tokens: int) -> bool:
        return num_output_tokens >= self.paused_until

    @property
    def alpha(self) -> float:
        total = self.successes + self.failures
        return self.successes / total if total > 0 else 0.5

    def record(self, drafted: int, accepted: int, config: SpecConfig, costs: SpecCosts,
               num_output_tokens: int) -> None:
        """After a verify step: adapt the draft length; pause when acceptance does not pay."""
        self.verifies += 1
        self.drafted += drafted
        self.accepted += accepted
        keep = 1 - config.ema
        self.successes = keep * self.successes + accepted
        self.failures = keep * self.failures + (1 if accepted < drafted else 0)
        best = costs.best_k(self.proposer, self.alpha, config.min_draft, config.max_draft)
        if best is None:
            self.k = min(config.max_draft, self.k + 2) if accepted == drafted else max(config.min_draft, accepted + 1)
            return
        self.k, self.last_gain = best
        if self.verifies >= config.probe_verifies and self.last_gain < 1.0:
            self.pauses += 1
            # back off longer each time it does not pay
            self.paused_until = num_output_tokens + config.cooldown_tokens * (1 << min(self.pauses - 1, 4))
            self.k = config.min_draft
            self.verifies = 0
            self.successes = self.failures = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else math.nan


# -- model drafters -------------------------------------------------------------------------------
@dataclass
class _DraftSeq:
    block_table: list[int] = field(default_factory=list)
    history: list[int] = field(default_factory=list)  # the tokens whose K/V this drafter's cache holds


@dataclass
class DraftRequest:
    """One sequence to draft for: its request id, all its tokens, how many to guess, and how to sample."""

    request_id: str
    tokens: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator | None


class ModelDrafter:
    """Drafts with a model over its own paged KV cache: the bundled draft model, or the target model itself at
    fewer experts per token (MoE self-speculation: same weights, its own cache, since the K/V of a layer
    depend on the experts the layers below it used).

    Per sequence it keeps the tokens its cache holds; a new proposal first rolls that back to the longest
    prefix still shared with the sequence (rejected drafts are forgotten), runs the rest in one batched step,
    then ``k - 1`` batched decode steps. Greedy requests draft by argmax; sampled ones draw from the same
    tempered, filtered distribution the target samples from and return it (``q`` for `verify`).
    """

    def __init__(self, backend: DecodeBackend, kv_caches: list[KVCache], *, num_blocks: int, block_size: int,
                 experts_per_token: int | None = None) -> None:
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.experts_per_token = experts_per_token
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching=False)
        self._seqs: dict[str, _DraftSeq] = {}

    def release(self, request_id: str) -> None:
        st = self._seqs.pop(request_id, None)
        if st is not None:
            self.allocator.free(st.block_table)

    @torch.inference_mode()
    def propose(self, requests: Seq[DraftRequest]) -> list[tuple[list[int], torch.Tensor | None]]:
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * len(requests)
        live: list[int] = []
        spans: list[Span] = []
        for i, r in enumerate(requests):
            st = self._seqs.setdefault(r.request_id, _DraftSeq())
            valid = 0
            limit = min(len(st.history), len(r.tokens) - 1)
            while valid < limit and st.history[valid] == r.tokens[valid]:
                valid += 1
            st.history = st.history[:valid]
            need = self.allocator.blocks_needed(len(r.tokens) + r.k - 1) - len(st.block_table)
            if need > self.allocator.num_free:
                self.release(r.request_id)  # no room: this sequence decodes plainly this step
                continue
            if need > 0:
                st.block_table.extend(self.allocator.allocate(need))
            live.append(i)
            catch_up = r.tokens[valid:]
            spans.append(Span(catch_up, valid, st.block_table, self.experts_per_token, 1,
                              as_decode_rows=len(catch_up) <= DECODE_ROWS_MAX))
        if not live:
            return out
        drafts: dict[int, list[int]] = {i: [] for i in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        step = 0
        while spans:
            logits = run_spans(self.backend, self.kv_caches, self.block_size, spans)
            for row, i in enumerate(live):
                r = requests[i]
                if r.params.greedy:
                    tok = int(logits[row].argmax())
                else:
                    q = target_probs(logits[row:row + 1], r.params)[0]
                    tok = int(torch.multinomial(q, 1, generator=r.generator).item())
                    probs[i].append(q)
                drafts[i].append(tok)
            step += 1
            live = [i for i in live if requests[i].k > step]
            spans = [Span([drafts[i][-1]], len(requests[i].tokens) + step - 1, self._seqs[requests[i].request_id]
                          .block_table, self.experts_per_token, 1) for i in live]
        for i, d in drafts.items():
            r = requests[i]
            self._seqs[r.request_id].history = [*r.tokens, *d[:-1]]
            out[i] = (d, torch.stack(probs[i]) if probs[i] else None)
        return out
