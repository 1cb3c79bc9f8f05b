"""What a request asks the sampler for, and what it reports back: plain data.

`SamplingParams` (temperature, filters, stop rules, logprobs) and `TokenLogprob` are frozen
dataclasses that the sequence, the scheduler and the gateway pass around; the torch sampler that
acts on them is `engine.sampling`.

Plain Python: must not import torch, the model, the sampler, or anything web/db.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks the sampler for.

    temperature 0 means greedy. ``top_k`` <= 0 and ``top_p`` >= 1 disable those filters.
    ``max_tokens`` None means "until the context is full". ``logprobs`` asks for the
    chosen token's log-probability; ``top_logprobs`` (0..20) for that many alternatives.
    Log-probabilities are those of the model's distribution (before temperature/filters),
    as OpenAI reports them.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    min_tokens: int = 0
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError("top_logprobs must be between 0 and 20")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the ``top_logprobs`` best alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
