"""Exact speculative decoding: the verify rule, the prompt-lookup proposer and the model drafters.

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

`ModelDrafter` runs a draft model (or the target at fewer experts) through the runner's `run_spans` over its
own paged cache. How many tokens to draft, and when, is `engine.spec_control`'s business.

Imports torch, engine.sampling, engine.blocks and engine.runner; never the model code, the scheduler's policy,
or anything web/db.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from engine.blocks import BlockAllocator
from engine.runner import DECODE_ROWS_MAX, DecodeBackend, KVCache, Span, run_spans
from engine.sampling import filter_top_k_top_p
from engine.sampling_params import SamplingParams


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
    """Up to ``k`` tokens that followed an earlier occurrence of the sequence's last n-gram (see
    `prompt_lookup_match`)."""
    return prompt_lookup_match(tokens, k, ngram_max, ngram_min)[0]


def prompt_lookup_match(tokens: Seq[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> tuple[list[int], int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the sequence's last n-gram, and that n-gram's
    length (how much context backs the guess).

    The longest match wins (up to ``ngram_max`` tokens, at least ``ngram_min``), the latest among equals;
    ([], 0) when nothing matches. Pure Python, scanning with ``list.index`` (C speed): the proposer of choice
    for copy-heavy answers (rewrites, edits, quotes) at no model cost.
    """
    seq = tokens if isinstance(tokens, list) else list(tokens)
    end = len(seq) - 1  # candidates end strictly before the last token
    if end < 1 or k < 1:
        return [], 0
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
        return [], 0
    return seq[best_at + 1:best_at + 1 + k], best_len


class NgramIndex:
    """`prompt_lookup_match` for one growing sequence in O(``ngram_max``) a step rather than a scan of it: the
    latest end position of every n-gram (n = 1..``ngram_max``) seen so far, extended as tokens are appended.
    Same answers as the scan (the longest match, the latest among equals); the sequence must only grow."""

    def __init__(self, ngram_max: int, ngram_min: int = 1) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram_max + 1)]
        self._indexed = 0  # positions below this are registered as n-gram ends

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        end = len(tokens) - 1  # candidates end strictly before the last token
        latest, top = self._latest, self.ngram_max
        for p in range(self._indexed, end):
            gram = tuple(tokens[max(p - top + 1, 0):p + 1])  # the longest n-gram ending at p; the others its tails
            for n in range(1, len(gram) + 1):
                latest[n][gram[-n:]] = p
        self._indexed = max(self._indexed, end)
        if k < 1:
            return [], 0
        for n in range(min(self.ngram_max, end + 1), self.ngram_min - 1, -1):
            at = self._latest[n].get(tuple(tokens[end - n + 1:]))
            if at is not None:
                return tokens[at + 1:at + 1 + k], n
        return [], 0


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

    def lag(self, request_id: str, tokens: Seq[int]) -> int:
        """How many of ``tokens`` (a sequence's, all but the last computed by the target) this drafter must run
        before it can draft: 1 or 2 while it keeps up, the whole prompt the first time."""
        st = self._seqs.get(request_id)
        history = st.history if st is not None else []
        valid, limit = 0, min(len(history), len(tokens) - 1)
        while valid < limit and history[valid] == tokens[valid]:
            valid += 1
        return len(tokens) - valid

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
            logits, argmax = self._run(spans)
            for row, i in enumerate(live):
                r = requests[i]
                if r.params.greedy:
                    tok = int(logits[row].argmax()) if argmax is None else argmax[row]
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

    def _run(self, spans: Seq[Span]) -> tuple[torch.Tensor, list[int] | None]:
        """The logits of each span's last token, and their argmax where the backend's decode fast path ran the
        step (every span a few tokens run as decode rows, or one token): it costs a fraction of a general
        forward."""
        if all(len(sp.tokens) == 1 or sp.as_decode_rows for sp in spans):
            tokens: list[int] = []
            positions: list[int] = []
            tables: list[list[int]] = []
            experts: list[int | None] = []
            last: list[int] = []
            for sp in spans:
                n = len(sp.tokens)
                tokens.extend(sp.tokens)
                positions.extend(range(sp.start, sp.start + n))
                tables.extend([sp.block_table] * n)
                experts.extend([sp.experts] * n)
                last.append(len(tokens) - 1)
            fast = self.backend.decode(tokens, positions, tables, experts, self.kv_caches, self.block_size)
            if fast is not None:
                logits, argmax = fast
                if len(last) == len(tokens):
                    return logits, list(argmax)
                return logits[last], [argmax[j] for j in last]
        return run_spans(self.backend, self.kv_caches, self.block_size, spans), None
