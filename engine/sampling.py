"""Sampling: the torch sampler that turns last-token logits into tokens.

`sample` takes the logits of every sequence that produces a token this step, with each one's
`SamplingParams` (plain data in `engine.sampling_params`, re-exported here), and returns the
chosen tokens plus, where asked, their log-probabilities and the top alternatives. Randomness
comes only from each request's own `torch.Generator`, so a request's tokens never depend on what
else shares its batch (and a preempted request resumes with identical output).

Imports torch and engine.sampling_params only; never the model, the scheduler or anything web/db.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams, TokenLogprob

__all__ = ["SamplingParams", "TokenLogprob", "filter_top_k_top_p", "make_generator", "sample"]


def make_generator(seed: int | None) -> torch.Generator:
    """A request's private RNG: seeded when asked, otherwise from fresh OS entropy."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits [V] with everything outside top-k / nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass *before* it already reaches top_p (always keeps the best one)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's first maximum (NaN counting as the maximum, as in torch.argmax); read through numpy on the
    CPU, which costs a microsecond where torch's argmax and tolist cost several per step."""
    if logits.device.type == "cpu" and not logits.requires_grad:
        return logits.numpy().argmax(axis=-1).tolist()  # type: ignore[no-any-return]
    return logits.argmax(dim=-1).tolist()  # type: ignore[no-any-return]


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           suppress: list[tuple[int, ...]] | None = None,
           argmax: list[int] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """Choose one token per row.

    logits: [S, V] float, one row per sequence that samples this step.
    params / generators: one per row. suppress: per row, token ids that may not be chosen
    (used for ``min_tokens``: end-of-sequence ids are suppressed until it is reached).
    argmax: each row's argmax (first maximum, NaN counting as the maximum) where the caller already has it
    (the runner's decode fast path computes it with the logits): an all-greedy batch with nothing suppressed
    and no log-probabilities asked then takes it as it is, without another pass over the logits.
    Returns (token ids, per-row TokenLogprob or None when the row did not ask for them).
    """
    masked = suppress is not None and any(suppress)
    if argmax is not None and not masked and all(p.greedy and not p.wants_logprobs for p in params):
        return list(argmax), [None] * len(params)
    logits = logits.float()
    if masked:
        assert suppress is not None
        logits = logits.clone()
        for row, ids in enumerate(suppress):
            if ids:
                logits[row, list(ids)] = float("-inf")
    tokens = _argmax_rows(logits)
    for row, p in enumerate(params):
        if p.greedy:
            continue
        row_logits = filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row_logits, dim=-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=generators[row]).item())
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    wanting = [row for row, p in enumerate(params) if p.wants_logprobs]
    if wanting:
        lp = torch.log_softmax(logits[wanting], dim=-1)
        for i, row in enumerate(wanting):
            chosen = float(lp[i, tokens[row]])
            k = params[row].top_logprobs
            top: tuple[tuple[int, float], ...] = ()
            if k:
                best = torch.topk(lp[i], k)
                top = tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
            logprobs[row] = TokenLogprob(tokens[row], chosen, top)
    return tokens, logprobs
