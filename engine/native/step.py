"""`DecodeStep`: a plain decode step (one new token per sequence) in one native call, token ids in, logits out.

The per-op and one-call paths start from the model's torch inputs: the embedding lookup, RoPE's cos/sin, the
paged plan and the flattened batch tensors cost about as much Python and torch time per step as a small
model's layers do in C (the demo model: ~0.2 ms of ~0.5 ms). A `DecodeStep` does all of that in
`tg_decode_step` instead: the embedding rows, the RoPE rows (of a table of every position, computed once with
the model's own `RotaryEmbedding`, which gives a position the same values whatever else is in its batch), the
cache slots from the block tables, the layers, the final norm, the packed LM head and each row's argmax (the
greedy token, so that a greedy step needs no torch or numpy call to pick it). Per step it copies the
token ids, positions and block tables into int64 buffers it keeps (a `BatchSpec` points at them), and makes
one ctypes call of six arguments; the only torch call left is the logits' allocation.

`decode_step` builds one where it applies: every layer on the one-call path (`engine.native.layers`), a packed
LM head in that path's formats, RoPE as wide as the heads, an fp32 embedding table; otherwise None, and the
backend's general path runs.

Must not import the scheduler, the runner, or anything web/db; torch, the engine's model types and
engine.native only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from engine.model import CausalLM, KVCache
from engine.moe import resolve_experts_per_token
from engine.native import layers as one_call
from engine.native import ops
from engine.native.packing import PackedWeights


class DecodeStep:
    """A model's decode step over one set of KV cache tensors, built by `decode_step`."""

    def __init__(self, model: CausalLM, spec: ops.ModelSpec, layers: ops.DecodeLayers, keep: list[object],
                 block_size: int) -> None:
        cfg = model.config
        self.vocab = cfg.vocab_size
        self.num_experts = cfg.num_experts if cfg.is_moe else 0
        self.default_k = cfg.num_experts_per_tok if cfg.is_moe else 0
        self._k_max: dict[int | None, int] = {}  # validated counts shared by a whole batch
        self._batch = ops.BatchSpec(block_size=block_size)
        self._call = ops.DecodeStepCall(spec, layers, self._batch, keep)
        self._capacity = self._width = 0
        self._grow(1, 1)

    def _grow(self, batch: int, width: int) -> None:
        """Buffers for ``batch`` sequences of ``width`` blocks, kept (the `BatchSpec` points at them)."""
        if batch <= self._capacity and width <= self._width:
            return
        self._capacity, self._width = max(batch, 2 * self._capacity), max(width, 2 * self._width)
        # ctypes arrays (typed Any: their slices take plain lists of ints)
        self._tokens: Any = (ctypes.c_int64 * self._capacity)()
        self._positions: Any = (ctypes.c_int64 * self._capacity)()
        self._tables: Any = (ctypes.c_int64 * (self._capacity * self._width))()
        self._ks: Any = (ctypes.c_int32 * self._capacity)()
        self._argmax: Any = (ctypes.c_int64 * self._capacity)()
        b = self._batch
        b.tokens, b.positions, b.tables, b.argmax = (
            ctypes.addressof(a) for a in (self._tokens, self._positions, self._tables, self._argmax))

    def __call__(self, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[list[int]],
                 experts: Sequence[int | None]) -> tuple[torch.Tensor, list[int]]:
        """Logits [B, vocab] of one decode step and each row's argmax (as torch.argmax picks it: the first
        maximum, or the first NaN): sequence ``i`` feeds ``tokens[i]`` at ``positions[i]`` over its cache blocks
        ``tables[i]``, with ``experts[i]`` experts per token (None: the trained count)."""
        batch = len(tokens)
        if batch == 1:  # the common case, written out
            table = tables[0]
            width = len(table)
            if width > self._width:
                self._grow(1, width)
            self._tokens[0], self._positions[0] = tokens[0], positions[0]
            self._tables[:width] = table
        else:
            width = max(len(t) for t in tables)
            self._grow(batch, width)
            self._tokens[:batch], self._positions[:batch] = tokens, positions
            for row, table in enumerate(tables):
                at = row * width
                self._tables[at:at + width] = table + [-1] * (width - len(table))
        b = self._batch
        b.B, b.width = batch, width
        self._experts(experts, batch)
        logits = torch.empty(batch, self.vocab, dtype=torch.float32)
        self._call(logits)
        return logits, self._argmax[:batch]

    def _experts(self, experts: Sequence[int | None], batch: int) -> None:
        """The batch's expert counts into the `BatchSpec`, validated as the model's forward validates them."""
        b = self._batch
        if not self.num_experts:
            b.k_max, b.k_per_token = 0, None
            return
        first = experts[0]
        if batch == 1 or all(k == first for k in experts):
            k = self._k_max.get(first)
            if k is None:
                k = self._k_max[first] = resolve_experts_per_token(first, 1, self.num_experts, self.default_k).k_max
            b.k_max, b.k_per_token = k, None
            return
        if any(k is None for k in experts):
            raise ValueError("mixed batches need an explicit experts_per_token on every sequence")
        count = resolve_experts_per_token(torch.tensor(experts), batch, self.num_experts, self.default_k)
        self._ks[:batch] = experts
        b.k_max, b.k_per_token = count.k_max, ctypes.addressof(self._ks)


def decode_step(model: CausalLM, packed: PackedWeights, caches: list[KVCache], block_size: int) -> DecodeStep | None:
    """The one-call decode step of ``model`` over ``caches``, or None where it does not apply (see the module
    docstring)."""
    layers = one_call.decode_layers(model, packed, caches)
    lm_head = packed.get(model.lm_head.weight)
    embed = model.model.embed_tokens.weight
    cfg = model.config
    if layers is None or lm_head is None or embed.dtype != torch.float32 or not embed.is_contiguous():
        return None
    if any(spec.head_dim != cfg.head_dim for spec in layers.array) or lm_head.k != cfg.hidden_size:
        return None
    with torch.inference_mode():
        cos, sin = model.model.rotary_emb(torch.arange(cfg.max_position_embeddings), torch.float32)
    cos, sin = cos.contiguous(), sin.contiguous()
    norm = model.model.norm
    spec = ops.ModelSpec(
        embed=embed.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), n_positions=cos.shape[0],
        rope_dim=cos.shape[1], final_norm=norm.weight.data_ptr(), final_eps=norm.eps, lm_fmt=lm_head.fmt,
        lm_head=lm_head.data.data_ptr(), vocab=lm_head.n, hidden=cfg.hidden_size)
    return DecodeStep(model, spec, layers, [embed, cos, sin, norm.weight, lm_head.data], block_size)
