"""The model runner: the only place that builds tensors for a step, owns the KV cache and
calls the model.

It turns the scheduler's decision (which sequences, how many new tokens each) into one
flattened batch: token ids and positions ``[T]``, an `AttentionContext` (query start
offsets, context lengths, cache slots, block tables) and the per-token expert count, and
returns the logits of the last token of each sequence that samples this step.

Imports torch and the engine's attention contract; must not import the scheduler's
policy, the sampler, or anything web/db.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence as Seq
from typing import Any

import torch

from engine.attention import AttentionContext
from engine.scheduler import ScheduledSequence


class ModelRunner:
    """Runs ``model`` over scheduled sequences with a paged KV cache of ``num_blocks`` blocks.

    ``model`` follows the engine's model contract: ``allocate_kv_cache(num_blocks,
    block_size, dtype)`` and ``forward(input_ids, positions, ctx, kv_caches,
    experts_per_token)`` returning logits ``[T, vocab]`` (or only the rows asked for with
    ``last_token_indices`` where the model supports it).
    """

    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = model.allocate_kv_cache(  # type: ignore[operator]
            num_blocks, block_size, dtype)
        params = inspect.signature(model.forward).parameters
        self._takes_last_token_indices = "last_token_indices" in params

    @torch.inference_mode()
    def execute(self, scheduled: Seq[ScheduledSequence]) -> torch.Tensor:
        """Run one step; returns logits ``[S, vocab]`` for the sequences with ``samples`` set, in order."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        context_lens: list[int] = []
        experts: list[int | None] = []
        tables: list[list[int]] = []
        last_rows: list[int] = []
        for s in scheduled:
            seq, begin, n = s.seq, s.start, s.num_new_tokens
            end = begin + n
            table = seq.block_table
            input_ids.extend(seq.token_ids[begin:end])
            if n == 1:
                positions.append(begin)
                slots.append(table[begin // bs] * bs + begin % bs)
            else:
                positions.extend(range(begin, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(begin, end))
            starts.append(starts[-1] + n)
            context_lens.append(end)
            experts.append(seq.experts_per_token)
            tables.append(table)
            if s.samples:
                last_rows.append(starts[-1] - 1)
        width = max(len(t) for t in tables)
        ctx = AttentionContext(
            is_prefill=any(s.num_new_tokens > 1 for s in scheduled),
            query_start_loc=torch.tensor(starts, dtype=torch.long),
            context_lens=torch.tensor(context_lens, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.long),
        )
        kwargs: dict[str, Any] = {}
        last = torch.tensor(last_rows, dtype=torch.long)
        if self._takes_last_token_indices:
            kwargs["last_token_indices"] = last
        logits = self.model(torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                            ctx, self.kv_caches, self._experts_arg(scheduled, experts), **kwargs)
        if self._takes_last_token_indices:
            return logits
        return logits[last]

    @staticmethod
    def _experts_arg(scheduled: Seq[ScheduledSequence],
                     experts: list[int | None]) -> torch.Tensor | int | None:
        """One int (or None = trained value) when the batch agrees, else a per-token tensor."""
        first = experts[0]
        if all(k == first for k in experts):
            return first
        if any(k is None for k in experts):
            raise ValueError("mixed batches need an explicit experts_per_token on every sequence")
        counts = torch.tensor([s.num_new_tokens for s in scheduled], dtype=torch.long)
        return torch.repeat_interleave(torch.tensor(experts, dtype=torch.long), counts)
