"""The model runner: the only place that builds tensors for a step, owns the KV cache and
picks the backend that runs the model.

It turns the scheduler's decision (which sequences, how many new tokens each) into one
flattened batch: token ids and positions ``[T]``, an `AttentionContext` (query start
offsets, context lengths, cache slots, block tables) and the per-token expert count, and
returns the logits of the last token of each sequence that samples this step.

The backend (`DecodeBackend`) is chosen once, when the runner is built: the native fast
backend (`engine.native`, packed weights and C kernels) for a fp32 `CausalLM` on the CPU
where the kernels are built, otherwise `TorchBackend`, the plain model run as it is. This
is the only module that imports `engine.native`.

Imports torch, the attention contract, the scheduler's `ScheduledSequence` and
engine.native; must not import the scheduler's policy, the sampler, or anything web/db.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence as Seq
from typing import Any, Protocol

import torch

from engine import native
from engine.attention import AttentionContext
from engine.scheduler import ScheduledSequence

KVCache = tuple[torch.Tensor, torch.Tensor]
DECODE_ROWS_MAX = 16  # at most this many tokens of one sequence run as decode rows (see `Span`)


class DecodeBackend(Protocol):
    """What runs the model for the runner, built once from it."""

    name: str

    @property
    def weight_format(self) -> str:
        """How the weights are read, e.g. ``"fp32"`` or ``"bf16 panels"`` (for reports)."""
        ...

    def describe(self) -> str:
        """One line: which path each kind of step takes."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                kv_caches: list[KVCache], experts_per_token: torch.Tensor | int | None = None,
                last_token_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Flattened input_ids / positions [T] over the paged cache -> logits [T, vocab], or only the
        rows ``last_token_indices``."""
        ...

    def memory_bandwidth(self, gib: float = 1.0, repeats: int = 5) -> float:
        """The best rate (bytes/s) this backend's memory reads at here: what a weight-bound decode step is
        measured against (`tiergate bench engine`)."""
        ...

    def decode(self, tokens: Seq[int], positions: Seq[int], block_tables: Seq[list[int]],
               experts: Seq[int | None], kv_caches: list[KVCache], block_size: int
               ) -> tuple[torch.Tensor, list[int]] | None:
        """Logits [B, vocab] of a plain decode step (sequence ``i`` feeds ``tokens[i]`` at ``positions[i]`` over
        its cache blocks ``block_tables[i]``, ``experts[i]`` experts per token) and each row's argmax (the first
        maximum or the first NaN, as torch.argmax), by a fast path, or None where the backend has none (the
        runner then calls `forward`)."""
        ...


class TorchBackend:
    """The model run as it is, in plain torch: for dtypes and devices the native backend does not take,
    and wherever its kernels are not built (``TIERGATE_ENGINE_NATIVE=0``).

    On the CPU its matrices are re-laid column-major in place (same values, still trainable): batch-1
    GEMV reads ``x @ W_t`` with a contiguous ``W_t`` faster than row-major `F.linear`. The embedding
    table stays row-major unless the LM head is tied to it (it is looked up by row).
    """

    name = "torch"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._takes_last_token_indices = "last_token_indices" in inspect.signature(model.forward).parameters
        self._dtype = next(model.parameters()).dtype
        self._relayout()

    @property
    def weight_format(self) -> str:
        return str(self._dtype).removeprefix("torch.")

    def describe(self) -> str:
        return f"torch backend, {self.weight_format}: the plain model"

    def _relayout(self) -> None:
        model: Any = self.model
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        lm_head = getattr(model, "lm_head", None)
        untied = embed.weight if embed is not None and (lm_head is None or lm_head.weight is not embed.weight) else None
        with torch.no_grad():
            for p in self.model.parameters():
                if p.device.type != "cpu" or p.stride(-1) != 1 or p is untied:
                    continue
                if p.dim() == 2:
                    p.data = p.data.t().contiguous().t()
                elif p.dim() == 3:
                    p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                kv_caches: list[KVCache], experts_per_token: torch.Tensor | int | None = None,
                last_token_indices: torch.Tensor | None = None) -> torch.Tensor:
        if not self._takes_last_token_indices:
            logits = self.model(input_ids, positions, ctx, kv_caches, experts_per_token)
            return logits if last_token_indices is None else logits[last_token_indices]
        return self.model(input_ids, positions, ctx, kv_caches, experts_per_token,  # type: ignore[no-any-return]
                          last_token_indices=last_token_indices)

    def memory_bandwidth(self, gib: float = 1.0, repeats: int = 5) -> float:
        x = torch.ones(int(gib * (1 << 30)) // 4)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
        return x.numel() * 4 / best

    def decode(self, tokens: Seq[int], positions: Seq[int], block_tables: Seq[list[int]],
               experts: Seq[int | None], kv_caches: list[KVCache], block_size: int
               ) -> tuple[torch.Tensor, list[int]] | None:
        return None  # no fast path: the plain model runs every step through forward


def pick_backend(model: torch.nn.Module, *, release_weights: bool = False) -> DecodeBackend:
    """The native backend where it supports ``model`` (see `engine.native.supports`), else `TorchBackend`.

    ``release_weights``: the native backend keeps the only copy of the packed matrices, and ``model`` can
    no longer run on its own (see `engine.native.packing`); the torch backend ignores it."""
    if native.supports(model):
        return native.prepare(model, release=release_weights)
    return TorchBackend(model)


class ModelRunner:
    """Runs ``model`` over scheduled sequences with a paged KV cache of ``num_blocks`` blocks.

    ``model`` follows the engine's model contract: ``allocate_kv_cache(num_blocks,
    block_size, dtype)`` and ``forward(input_ids, positions, ctx, kv_caches,
    experts_per_token)`` returning logits ``[T, vocab]`` (or only the rows asked for with
    ``last_token_indices`` where the model supports it). ``release_weights``: see `pick_backend`.
    """

    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, release_weights: bool = False) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches: list[KVCache] = model.allocate_kv_cache(  # type: ignore[operator]
            num_blocks, block_size, dtype)
        self.backend = pick_backend(model, release_weights=release_weights)
        # the argmax of each row of the logits the last `execute` returned, where the backend's decode fast path
        # computed it with them (None otherwise): a greedy sampler's tokens without another pass over the logits
        self.last_argmax: list[int] | None = None

    def execute(self, scheduled: Seq[ScheduledSequence]) -> torch.Tensor:
        """Run one step; returns logits for the sequences with ``samples`` set, in order: one row each, or
        ``1 + num_spec`` rows for a sequence verifying ``num_spec`` speculative tokens (the rows of its last
        known token and of each draft token).

        A step of plain decodes goes to the backend's `decode` fast path first (no torch graph is built
        there, so it runs outside inference mode: entering and leaving it costs ~10 us a step)."""
        self.last_argmax = None
        if all(s.num_new_tokens == 1 and s.samples and not s.num_spec for s in scheduled):
            seqs = [s.seq for s in scheduled]
            fast = self.backend.decode([q.token_ids[s.start] for q, s in zip(seqs, scheduled, strict=True)],
                                       [s.start for s in scheduled], [q.block_table for q in seqs],
                                       [q.experts_per_token for q in seqs], self.kv_caches, self.block_size)
        elif all(s.samples and s.num_new_tokens - s.num_spec == 1 and s.num_spec <= DECODE_ROWS_MAX
                 for s in scheduled):
            fast = self._decode_with_drafts(scheduled)
        else:
            fast = None
        if fast is not None:
            logits, self.last_argmax = fast
            return logits
        return self._execute_spans(scheduled)

    def _decode_with_drafts(self, scheduled: Seq[ScheduledSequence]) -> tuple[torch.Tensor, list[int]] | None:
        """A step of decodes some of which verify drafts, by the backend's decode fast path: each draft token is
        one more decode row of its sequence (see `Span`'s ``as_decode_rows``), so a verify of ``k`` drafts costs a
        decode step of ``k + 1`` rows rather than a general forward. None where the backend has no fast path."""
        tokens: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        experts: list[int | None] = []
        for s in scheduled:
            q = s.seq
            tokens.append(q.token_ids[s.start])
            tokens.extend(q.spec_token_ids[:s.num_spec])
            positions.extend(range(s.start, s.start + 1 + s.num_spec))
            tables.extend([q.block_table] * (1 + s.num_spec))
            experts.extend([q.experts_per_token] * (1 + s.num_spec))
        return self.backend.decode(tokens, positions, tables, experts, self.kv_caches, self.block_size)

    @torch.inference_mode()
    def _execute_spans(self, scheduled: Seq[ScheduledSequence]) -> torch.Tensor:
        spans = []
        for s in scheduled:
            seq = s.seq
            real = s.num_new_tokens - s.num_spec
            tokens = seq.token_ids[s.start:s.start + real]
            if s.num_spec:
                tokens = tokens + seq.spec_token_ids[:s.num_spec]
            rows = (1 + s.num_spec) if s.samples else 0
            spans.append(Span(tokens, s.start, seq.block_table, seq.experts_per_token, rows,
                              as_decode_rows=s.num_spec > 0))
        return run_spans(self.backend, self.kv_caches, self.block_size, spans)


class Span:
    """``tokens`` at positions ``start ..`` of one sequence whose cache blocks are ``block_table``; the logits
    of its last ``rows`` tokens come back.

    ``as_decode_rows``: run the tokens as that many one-token rows sharing the block table, row ``i`` seeing
    the cache up to its own position (every row's K/V is written before any row attends, in every backend),
    so a few tokens (a speculative draft being verified) take the decode path, batched like decodes of
    different sequences, rather than the prefill path built for long chunks."""

    __slots__ = ("as_decode_rows", "block_table", "experts", "rows", "start", "tokens")

    def __init__(self, tokens: list[int], start: int, block_table: list[int], experts: int | None,
                 rows: int, as_decode_rows: bool = False) -> None:
        self.tokens, self.start, self.block_table, self.experts, self.rows = tokens, start, block_table, experts, rows
        self.as_decode_rows = as_decode_rows


def run_spans(backend: DecodeBackend, kv_caches: list[KVCache], bs: int, spans: Seq[Span]) -> torch.Tensor:
    """One flattened forward over ``spans`` (see `Span`) against a paged cache; logits of the asked rows."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    context_lens: list[int] = []
    experts: list[int | None] = []
    tables: list[list[int]] = []
    last_rows: list[int] = []
    counts: list[int] = []
    for sp in spans:
        begin, n, table = sp.start, len(sp.tokens), sp.block_table
        end = begin + n
        input_ids.extend(sp.tokens)
        if sp.as_decode_rows and n > 1:
            for p in range(begin, end):
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                starts.append(starts[-1] + 1)
                context_lens.append(p + 1)
                experts.append(sp.experts)
                tables.append(table)
                counts.append(1)
            if sp.rows:
                last_rows.extend(range(starts[-1] - sp.rows, starts[-1]))
            continue
        if n == 1:
            positions.append(begin)
            slots.append(table[begin // bs] * bs + begin % bs)
        else:
            positions.extend(range(begin, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(begin, end))
        starts.append(starts[-1] + n)
        context_lens.append(end)
        experts.append(sp.experts)
        tables.append(table)
        counts.append(n)
        if sp.rows:
            last_rows.extend(range(starts[-1] - sp.rows, starts[-1]))
    width = max(len(t) for t in tables)
    ctx = AttentionContext(
        is_prefill=any(c > 1 for c in counts),
        query_start_loc=torch.tensor(starts, dtype=torch.long),
        context_lens=torch.tensor(context_lens, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.long),
    )
    return backend.forward(torch.tensor(input_ids, dtype=torch.long),
                           torch.tensor(positions, dtype=torch.long), ctx, kv_caches,
                           _experts_arg(counts, experts), torch.tensor(last_rows, dtype=torch.long))


def _experts_arg(counts: list[int], experts: list[int | None]) -> torch.Tensor | int | None:
    """One int (or None = trained value) when the batch agrees, else a per-token tensor."""
    first = experts[0]
    if all(k == first for k in experts):
        return first
    if any(k is None for k in experts):
        raise ValueError("mixed batches need an explicit experts_per_token on every sequence")
    return torch.repeat_interleave(torch.tensor(experts, dtype=torch.long), torch.tensor(counts, dtype=torch.long))
