"""One request's state inside the engine: its tokens, how many of them have K/V in the
cache, the blocks that hold them, and its lifecycle status.

Plain Python (no torch), so the scheduler and block allocator are testable with lists.
``sampler_state`` and ``detokenizer`` are opaque slots the engine fills in; this module
never looks inside them. Must not import torch, the model, or anything web/db.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request being served.

    ``token_ids`` is prompt + output. ``num_computed_tokens`` of them have K/V in the
    cache; the rest are computed by coming steps. After a preemption (by recompute) the
    sequence keeps its tokens, loses its blocks, and starts over with
    ``num_computed_tokens = 0``; the next token is only sampled once every known token
    has been computed again, so resumed output is identical.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    experts_per_token: int | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the leading full, computed blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    admitted_once: bool = False
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    sampler_state: Any = None
    detokenizer: Any = None
    cache_salt: str | None = None       # e.g. the tenant: prefix-cache blocks are shared only within one salt
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify in the next step
    spec_probs: Any = None              # the draft's distributions over them (None: a deterministic draft)
    spec: Any = None                    # the engine's speculative-decoding state for this sequence

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prefix_salt(self) -> object:
        """What besides the tokens decides this sequence's K/V or who may share them (see `prefix_root`)."""
        return self.experts_per_token if self.cache_salt is None else (self.experts_per_token, self.cache_salt)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
