"""`Speculator`: an engine's speculative decoding — which decoding sequences draft this step and how many tokens,
the model drafters, checking a draft against the target's logits, and what each step teaches the controller.

The engine calls `propose` before scheduling (it fills ``seq.spec_token_ids``), `verify` for each sequence
whose draft ran, `record` after the step with its duration, and `release` when a sequence ends.

How many tokens (`engine.spec_control`): until a proposer has a few verify steps across the engine a sequence
drafts a heuristic length; then every step takes the length with the best expected net gain from the measured
plain / verify / drafting costs and the proposer's acceptance per draft position — per n-gram match length
for prompt lookup, which looks up every step (it costs ~0.02 ms) and drafts only where that pays; a model
drafter whose best length is 0 pauses the sequence (for longer each time) and probes again after it. New
requests start plain while a proposer pays nowhere, except a probe after ``engine_probe_every`` of them, then
after twice as many each time its probe finds it still does not pay (up to ``PROBE_GAP_MAX`` times as many).

Imports torch, engine.speculative, engine.spec_control, engine.runner (the drafters' backends) and the plain
sequence and scheduler types; nothing web/db.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from engine.runner import ModelRunner, pick_backend
from engine.sampling_params import TokenLogprob
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence
from engine.spec_control import Acceptance, SpecConfig, SpecCosts, SpecState, SpecTotals, best_draft
from engine.speculative import DraftRequest, ModelDrafter, NgramIndex, verify

PROBE_GAP_MAX = 8  # requests between probes of a proposer that pays nowhere: at most this many engine_probe_every
LOOKUP_TIMED_EVERY = 8  # prompt lookup's cost (for reports) is recorded at one step in this many
CATCH_UP = 2  # a model drafter this many tokens behind is keeping up (the bonus token, the last draft)
Suppressed = Callable[[Sequence, int], tuple[int, ...]]  # ids the offset-th next token of a sequence may not be


class Speculator:
    def __init__(self, config: SpecConfig, runner: ModelRunner, *, kv_dtype: torch.dtype,
                 draft_model: torch.nn.Module | None, max_model_len: int) -> None:
        self.config = config
        self.runner = runner
        self.costs = SpecCosts()
        self.totals: dict[str, SpecTotals] = {}
        self.acceptance: dict[tuple[str, int], Acceptance] = {}
        self.drafters: dict[str, ModelDrafter] = {}
        self._lookups: dict[str, NgramIndex] = {}  # per prompt-lookup request
        self._looked = 0  # steps at which prompt lookup proposed
        self._draft_model = draft_model
        self._kv_dtype = kv_dtype
        self._max_model_len = max_model_len

    # -- per request --------------------------------------------------------------------------------
    def new_state(self, proposer: str) -> SpecState:
        """A new request's state: plain for the whole request while ``proposer`` pays nowhere on this engine
        (a request now and then still probes: see the module docstring)."""
        cfg = self.config
        state = SpecState(proposer, cfg.initial_draft)
        totals = self.totals.setdefault(proposer, SpecTotals())
        if totals.verifies >= cfg.engine_probe_verifies and not self._pays(proposer):
            totals.skipped += 1
            if totals.skipped < (totals.next_probe or cfg.engine_probe_every):
                state.paused_until = self._max_model_len
            else:  # drafts once, whatever the estimate says: fresh evidence; the next probe twice as far off
                state.probing = True
                totals.probe_gap = min(2 * totals.probe_gap, PROBE_GAP_MAX * cfg.engine_probe_every) \
                    if totals.probe_gap else cfg.engine_probe_every
                totals.next_probe = totals.skipped + totals.probe_gap
        elif totals.probe_gap:  # it pays again: back to probing every engine_probe_every once it stops paying
            totals.probe_gap = 0
            totals.next_probe = totals.skipped + cfg.engine_probe_every
        return state

    def _pays(self, proposer: str) -> bool:
        buckets = range(1, self.config.ngram_max + 1) if proposer == "prompt_lookup" else (0,)
        for bucket in buckets:
            best = best_draft(self.costs, proposer, self._acceptance(proposer, bucket), self.config.max_draft)
            if best is None or best[0] > 0:
                return True
        return False

    def _acceptance(self, proposer: str, bucket: int) -> Acceptance:
        key = (proposer, bucket)
        if key not in self.acceptance:
            self.acceptance[key] = Acceptance(self.config.max_draft)
        return self.acceptance[key]

    def drafter(self, proposer: str) -> ModelDrafter:
        """The model drafter for ``draft`` or ``self`` (built, with its own KV cache, on first use)."""
        drafter = self.drafters.get(proposer)
        if drafter is None:
            nb, bs = self.runner.num_blocks, self.runner.block_size
            if proposer == "self":
                model: Any = self.runner.model
                drafter = ModelDrafter(self.runner.backend, model.allocate_kv_cache(nb, bs, self._kv_dtype),
                                       num_blocks=nb, block_size=bs, experts_per_token=1)
            else:
                draft: Any = self._draft_model
                drafter = ModelDrafter(pick_backend(draft), draft.allocate_kv_cache(nb, bs, self._kv_dtype),
                                       num_blocks=nb, block_size=bs)
            self.drafters[proposer] = drafter
        return drafter

    def release(self, seq: Sequence) -> None:
        self._lookups.pop(seq.request_id, None)
        if seq.spec is not None and seq.spec.proposer in self.drafters:
            self.drafters[seq.spec.proposer].release(seq.request_id)

    # -- before the step ----------------------------------------------------------------------------
    def propose(self, running: Iterable[Sequence]) -> float:
        """Give each decoding sequence that speculates this step a draft (``seq.spec_token_ids``); returns the
        seconds spent proposing."""
        cfg = self.config
        start = time.perf_counter()
        looked = 0
        groups: dict[str, list[tuple[Sequence, int, int]]] = {}
        plain_step: bool | None = None
        for seq in running:
            st: SpecState | None = seq.spec
            if st is None or seq.num_uncomputed_tokens != 1 or not st.active(seq.num_output_tokens):
                continue
            if plain_step is None:
                plain_step = self.costs.needs_plain()
            if plain_step:  # now and then a step without drafts: the plain step's cost, measured lately
                continue
            cap = min(cfg.max_draft, self._max_model_len - seq.num_tokens - 1)
            if seq.params.max_tokens is not None:
                cap = min(cap, seq.params.max_tokens - seq.num_output_tokens - 1)
            if cap < 1:
                continue
            if st.proposer == "prompt_lookup":
                looked += 1
                index = self._lookups.get(seq.request_id)
                if index is None:
                    index = self._lookups[seq.request_id] = NgramIndex(cfg.ngram_max, cfg.ngram_min)
                draft, matched = index.lookup(seq.token_ids, cap)
                if not draft:
                    self.totals[st.proposer].no_guess += 1
                    continue
                st.bucket = matched
                k = self._length(st, matched, len(draft))
                seq.spec_token_ids, seq.spec_probs = draft[:k], None
            else:
                k = self._length(st, 0, cap)
                lag = self.drafter(st.proposer).lag(seq.request_id, seq.token_ids)
                left = (seq.params.max_tokens - seq.num_output_tokens if seq.params.max_tokens is not None
                        else self._max_model_len - seq.num_tokens)
                if k and lag > CATCH_UP and not self._recoups(st.proposer, k, lag, left):
                    k = 0
                if k:
                    groups.setdefault(st.proposer, []).append((seq, k, lag))
                elif self.totals[st.proposer].verifies >= cfg.engine_probe_verifies:
                    st.paused_until = self._max_model_len  # the engine knows enough: plain to the end
                else:
                    st.pause(seq.num_output_tokens, cfg)  # probes again after a while
        spent = time.perf_counter() - start
        if looked:
            self._looked += 1
            if self._looked % LOOKUP_TIMED_EVERY == 1:  # nothing chooses by it: a sample of the steps is enough
                self.costs.record_draft("prompt_lookup", spent / looked, 0)
        for proposer, items in groups.items():
            begin = time.perf_counter()
            drafts = self.drafter(proposer).propose([
                DraftRequest(seq.request_id, seq.token_ids, k, seq.params, seq.sampler_state) for seq, k, _ in items])
            for (seq, _, _), (tokens, probs) in zip(items, drafts, strict=True):
                seq.spec_token_ids, seq.spec_probs = tokens, probs
            seconds = time.perf_counter() - begin
            spent += seconds
            drafted = sum(len(seq.spec_token_ids) for seq, _, _ in items)
            behind = sum(lag for _, _, lag in items if lag > CATCH_UP)
            per_token = self.costs.draft_token.get(proposer)
            if not behind:
                self.costs.record_draft(proposer, seconds / len(items), drafted / len(items))
            elif per_token is not None:  # what the drafting would have cost: the rest is the catch-up
                self.costs.record_catch_up(proposer, max(seconds - drafted * per_token, 0.0), behind)
            else:  # drafting not yet measured alone: the whole call per draft token bounds it (never free)
                self.costs.record_draft_bound(proposer, seconds / len(items), drafted / len(items))
        return spent

    def _recoups(self, proposer: str, k: int, lag: int, left: int) -> bool:
        """Whether drafting up to ``k`` tokens a step for the rest of a sequence (``left`` more tokens at most) is
        predicted to save more than the drafter's catch-up over ``lag`` tokens costs (True while either is
        unmeasured)."""
        best = best_draft(self.costs, proposer, self._acceptance(proposer, 0), k)
        per_token = self.costs.catch_up_token.get(proposer)
        plain = self.costs.plain_step()
        if best is None or per_token is None or plain is None:
            return True
        tokens = 1 + sum(self._acceptance(proposer, 0).survival(best[0]))
        return best[1] * left / tokens > lag * per_token / plain

    def _length(self, st: SpecState, bucket: int, cap: int) -> int:
        """How many tokens ``st``'s sequence drafts now (at most ``cap``; 0: decode plainly)."""
        cfg = self.config
        totals = self.totals[st.proposer]
        if st.probing:  # back from a pause, or a request sent to probe: draft at the heuristic length
            st.probing = False
            return min(st.k, cap)
        best = None if totals.verifies < cfg.probe_verifies else best_draft(
            self.costs, st.proposer, self._acceptance(st.proposer, bucket), cap)
        if best is None:
            return min(st.k, cap)
        if best[0] == 0:
            totals.declined += 1
            if st.proposer == "prompt_lookup" and totals.declined % cfg.engine_probe_every == 0:
                return 1  # free to propose: keep a little evidence on the guesses it declines
        return best[0]

    # -- the step's results -------------------------------------------------------------------------
    def verify(self, s: ScheduledSequence, logits: torch.Tensor, suppressed: Suppressed,
               argmax: list[int] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """Check ``s``'s draft against the target's ``1 + num_spec`` rows of logits (see `verify`); ``argmax``:
        each row's argmax where the step computed it (a greedy check then reads no logits)."""
        seq, p = s.seq, s.seq.params
        draft = seq.spec_token_ids[:s.num_spec]
        masks = [suppressed(seq, j) for j in range(len(draft) + 1)]
        if p.greedy and argmax is not None and not any(masks):  # the step's argmax is the check: no logits read
            n = 0
            while n < len(draft) and draft[n] == argmax[n]:
                n += 1
            tokens = [*draft[:n], argmax[n]]
        else:
            logits = logits.float()
            if any(masks):
                logits = logits.clone()
                for j, ids in enumerate(masks):
                    if ids:
                        logits[j, list(ids)] = float("-inf")
            tokens = verify(logits, draft, p, seq.sampler_state, seq.spec_probs)
        lps: list[TokenLogprob | None] = [None] * len(tokens)
        if p.wants_logprobs:
            lp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
            for j, t in enumerate(tokens):
                top: tuple[tuple[int, float], ...] = ()
                if p.top_logprobs:
                    best = torch.topk(lp[j], p.top_logprobs)
                    top = tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
                lps[j] = TokenLogprob(t, float(lp[j, t]), top)
        return tokens, lps

    def record(self, scheduled: list[ScheduledSequence], accepted: dict[Sequence, int], seconds: float) -> None:
        """Feed the step's cost (all of it but proposing: scheduling, the model, sampling or verifying) and each
        verifying sequence's acceptance to the controller. Only all-decode steps are timed (a prefill chunk
        would swamp the comparison); a step's cost is per sequence, at its mean draft length."""
        if all(s.num_new_tokens - s.num_spec == 1 and s.samples for s in scheduled):
            per_seq = seconds / len(scheduled)
            if accepted:
                self.costs.record_verify(per_seq, max(1, round(sum(s.num_spec for s in scheduled) / len(scheduled))))
            else:
                self.costs.record_plain(per_seq)
        for s in scheduled:
            if not s.num_spec:
                continue
            st: SpecState = s.seq.spec
            kept = accepted[s.seq]
            totals = self.totals[st.proposer]
            totals.verifies += 1
            totals.drafted += s.num_spec
            totals.accepted += kept
            totals.rejections += kept < s.num_spec
            totals.emitted += kept + 1
            totals.positions.record(s.num_spec, kept)
            st.record(s.num_spec, kept, self.config)
            self._acceptance(st.proposer, st.bucket).record(s.num_spec, kept)
