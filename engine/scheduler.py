"""Continuous-batching scheduler: which sequences run in the next step, and how many of
their tokens.

Each step mixes decodes (one new token) and prefills (many, possibly chunked) under a
token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``). Running
sequences go first, in arrival order; when the cache runs out of blocks the latest
arrival is preempted by recompute (blocks freed, tokens kept, put back at the head of the
queue). Waiting sequences are admitted first-come first-served, reusing prefix-cache
blocks where their prompt matches.

Plain Python (no torch): testable with lists. Must not import the runner, the model or
anything web/db.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.blocks import BlockAllocator, block_hash, prefix_root
from engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    """Tokens ``start .. start + num_new_tokens`` of ``seq`` run this step.

    ``samples`` is True when they reach the sequence's last known token, so the step
    yields its next token (False for a chunk of a longer prefill). Fixed at scheduling
    time: it stays valid after ``Scheduler.advance``. ``num_spec`` of the new tokens are
    the sequence's speculative draft (``seq.spec_token_ids``), run after its last known
    token to be verified.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool
    num_spec: int = 0

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int, num_spec: int = 0) -> ScheduledSequence:
        start = seq.num_computed_tokens
        return cls(seq, start, num_new_tokens, start + num_new_tokens - num_spec == seq.num_tokens, num_spec)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, allocator: BlockAllocator, *, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- membership ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished (stop, length, abort) and give back its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0:  # nothing to compute (cannot happen for an unfinished sequence)
                i += 1
                continue
            spec = len(seq.spec_token_ids)
            if spec and (seq.num_uncomputed_tokens != 1 or 1 + spec > budget or self.allocator.blocks_needed(
                    seq.num_tokens + spec) - len(seq.block_table) > self.allocator.num_free):
                # drafts only ride on a plain decode, when the budget holds them all, and never preempt anyone
                spec = 0
                seq.spec_token_ids, seq.spec_probs = [], None
            if not self._grow(seq, n + spec, out):
                break  # seq itself was preempted; everything after it already was
            out.scheduled.append(ScheduledSequence.of(seq, n + spec, spec))
            budget -= n + spec
            i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _grow(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Give a running ``seq`` blocks for ``n`` more tokens, preempting later arrivals."""
        need = self.allocator.blocks_needed(seq.num_computed_tokens + n) - len(seq.block_table)
        while need > self.allocator.num_free:
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.allocator.allocate(need))
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            seq.spec_token_ids, seq.spec_probs = [], None  # a fresh admission runs its prompt first
            hits = self.allocator.lookup_prefix(seq.token_ids, prefix_root(seq.prefix_salt))
            computed = len(hits) * self.allocator.block_size
            n = min(seq.num_tokens - computed, budget)
            need = self.allocator.blocks_needed(computed + n) - len(hits)
            if need > self.allocator.num_free_after_acquire(hits):
                break  # first come, first served: do not let later requests jump the queue
            self.waiting.popleft()
            self.allocator.acquire(hits)
            seq.block_table = hits + self.allocator.allocate(need)
            seq.num_computed_tokens = computed
            seq.block_hashes = self._hashes_of(seq, len(hits))
            if not seq.admitted_once:
                seq.num_cached_tokens = computed
                seq.admitted_once = True
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence.of(seq, n))
            budget -= n

    def _hashes_of(self, seq: Sequence, num_blocks: int) -> list[int]:
        hashes: list[int] = []
        bs = self.allocator.block_size
        for i in range(num_blocks):
            parent = hashes[-1] if hashes else prefix_root(seq.prefix_salt)
            hashes.append(block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        seq.spec_token_ids, seq.spec_probs = [], None
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    # -- after the model ran ------------------------------------------------------------------
    def advance(self, out: SchedulerOutput, accepted: Mapping[Sequence, int] | None = None) -> None:
        """Account for the tokens the step computed and publish newly full blocks to the cache.

        Call after the model ran and before appending sampled tokens. ``accepted``: for each
        sequence that verified a draft, how many leading draft tokens were accepted. Only
        those keep their K/V: the computed count rolls back past the rejected ones (their
        slots are overwritten later), blocks beyond the next token are given back, and only
        blocks made entirely of accepted tokens are published to the prefix cache.
        """
        bs = self.allocator.block_size
        for s in out.scheduled:
            seq = s.seq
            tokens = seq.token_ids
            if s.num_spec:
                kept = (accepted or {}).get(seq, 0)
                if not 0 <= kept <= s.num_spec:
                    raise ValueError(f"accepted {kept} of {s.num_spec} draft tokens")
                seq.num_computed_tokens += s.num_new_tokens - s.num_spec + kept
                tokens = tokens + seq.spec_token_ids[:kept]
                spare = seq.block_table[self.allocator.blocks_needed(seq.num_computed_tokens + 1):]
                if spare:  # blocks that only held rejected drafts
                    del seq.block_table[len(seq.block_table) - len(spare):]
                    self.allocator.free(spare)
                seq.spec_token_ids, seq.spec_probs = [], None
            else:
                seq.num_computed_tokens += s.num_new_tokens
            full = seq.num_computed_tokens // bs
            while len(seq.block_hashes) < full:
                i = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else prefix_root(seq.prefix_salt)
                seq.block_hashes.append(
                    self.allocator.register(seq.block_table[i], parent, tokens[i * bs:(i + 1) * bs]))
