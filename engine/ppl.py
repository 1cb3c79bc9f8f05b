"""Perplexity of a model as the engine serves it, per weight quantization: what ``q8_0`` / ``q4_0`` cost.

`engine_perplexity` loads the model once per scheme (`engine.model.load_model(..., quantization=...)`),
builds the runner's backend for it (the native kernels where they are built: fp32/bf16 panels for ``none``,
Q8_0/Q4_0 blocks with int8 activations otherwise; the plain-torch model elsewhere) and scores consecutive
non-overlapping windows of a token stream, each as one prefill over a fresh paged KV cache: exp(mean
next-token loss). ``tiergate engine eval-ppl --quantization ...`` prints it with the change against ``none``.

Imports torch, the engine's model loader, attention contract and runner (for the backend); nothing web/db.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention import AttentionContext
from engine.model import load_model
from engine.quant import check_scheme
from engine.runner import DecodeBackend, pick_backend

BLOCK_SIZE = 16


@dataclass(frozen=True)
class PerplexityResult:
    scheme: str
    k: int | None
    perplexity: float
    tokens: int
    weight_format: str
    weight_bytes: int  # bytes of the quantized blocks (0 for "none")


def window_nll(backend: DecodeBackend, model: torch.nn.Module, window: torch.Tensor, k: int | None) -> float:
    """Summed next-token negative log-likelihood of ``window`` [n + 1] (one prefill of its first n tokens)."""
    inputs, targets = window[:-1].long(), window[1:].long()
    n = inputs.numel()
    blocks = -(-n // BLOCK_SIZE)
    caches = model.allocate_kv_cache(blocks, BLOCK_SIZE, torch.float32)  # type: ignore[operator]
    ctx = AttentionContext(
        is_prefill=n > 1,
        query_start_loc=torch.tensor([0, n], dtype=torch.long),
        context_lens=torch.tensor([n], dtype=torch.long),
        slot_mapping=torch.arange(n, dtype=torch.long),
        block_tables=torch.arange(blocks, dtype=torch.long)[None],
    )
    with torch.inference_mode():
        logits = backend.forward(inputs, torch.arange(n, dtype=torch.long), ctx, caches, k)
    return float(F.cross_entropy(logits.float(), targets, reduction="sum"))


def engine_perplexity(model_dir: str | Path, ids: torch.Tensor, schemes: Sequence[str], ks: Sequence[int | None],
                      window: int, max_windows: int | None = None) -> list[PerplexityResult]:
    """Perplexity of ``ids`` (a 1-D token stream) for each scheme and expert count, on the engine's backend."""
    for scheme in schemes:
        check_scheme(scheme)
    starts = list(range(0, max(0, ids.numel() - 1), window))[:max_windows]
    windows = [ids[s : s + window + 1] for s in starts]
    windows = [w for w in windows if w.numel() >= 2]
    if not windows:
        raise ValueError("no tokens to evaluate")
    results: list[PerplexityResult] = []
    for scheme in schemes:
        model, _ = load_model(model_dir, quantization=scheme)
        blocks = model.quantized.nbytes if model.quantized is not None else 0
        backend = pick_backend(model)
        for k in ks:
            total = sum(window_nll(backend, model, w, k) for w in windows)
            count = sum(w.numel() - 1 for w in windows)
            results.append(PerplexityResult(scheme, k, math.exp(total / count), count, backend.weight_format, blocks))
    return results
