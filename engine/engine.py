"""`LLMEngine`: requests in, tokens and text out, one scheduling step at a time.

``add_request`` queues a prompt (token ids) with its `SamplingParams` and expert count;
``step`` schedules a batch, runs the model once, samples, applies stop rules and returns
one `RequestOutput` (the new tokens/text since the last output) per sequence that
produced a token; ``abort`` cancels a request and frees its blocks; ``generate`` runs a
list of prompts to completion. Synchronous and single-threaded: `engine.async_engine`
drives it from a background thread.

Imports torch and the engine's own modules; never anything web/db.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.blocks import BlockAllocator
from engine.detokenizer import IncrementalDetokenizer
from engine.runner import ModelRunner
from engine.sampling import make_generator, sample
from engine.sampling_params import SamplingParams, TokenLogprob
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.spec_control import MODES, SpecConfig
from engine.speculator import Speculator

DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024


class EngineError(Exception):
    """A request the engine cannot serve."""


class PromptTooLong(EngineError, ValueError):
    """The prompt does not fit the context window."""


class InvalidExperts(EngineError, ValueError):
    """experts_per_token outside 1..num_experts (or set on a dense model)."""


class InvalidSpeculative(EngineError, ValueError):
    """A speculative mode this engine does not know or cannot run (no draft model, a dense model)."""


@dataclass
class RequestOutput:
    """What one request produced in one step (deltas), plus running totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    text: str = ""                      # all text so far (final text when finished)
    output_token_ids: list[int] = field(default_factory=list)  # filled in when finished


@dataclass(frozen=True)
class EngineLimits:
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


class LLMEngine:
    def __init__(self, model: torch.nn.Module, config: Any, *, tokenizer: Any = None,
                 eos_token_ids: Seq[int] | None = None, dtype: torch.dtype = torch.float32,
                 block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES, max_model_len: int | None = None,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 enable_prefix_caching: bool = True, release_weights: bool = False,
                 speculative: SpecConfig | None = None, draft_model: torch.nn.Module | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        """``model``/``config``: a `CausalLM` and its `ModelConfig`. The KV cache gets ``num_blocks``
        blocks of ``block_size`` tokens (default: as many as ``kv_cache_bytes`` holds, at least one
        full context, at most ``max_num_seqs`` full contexts). ``max_model_len`` caps prompt +
        output (default and ceiling: the model's ``max_position_embeddings``). Each step computes
        at most ``max_num_batched_tokens`` tokens for at most ``max_num_seqs`` sequences.
        ``release_weights``: the runner's fast backend keeps the only copy of the model's large
        matrices (held once, not twice); ``model`` can then no longer run on its own. `from_dir`
        sets it, since nothing else holds the model it loads.

        ``speculative``: speculative-decoding settings (default: off unless a request asks);
        ``draft_model``: a small `CausalLM` with the same vocabulary, for the ``draft`` proposer.
        ``kv_dtype``: the KV cache's dtype (default ``dtype``); ``torch.int8`` stores each head's K/V row
        as int8 with one fp32 scale (about 3.6x smaller than fp32 at head_dim 32, so more blocks fit
        ``kv_cache_bytes``), dequantized on read on the plain-torch attention path."""
        self.config = config
        self.tokenizer = tokenizer
        self.num_experts = int(getattr(config, "num_experts", 0) or 0)
        self.default_experts_per_token = int(getattr(config, "num_experts_per_tok", 0) or 0) or None
        if eos_token_ids is None:
            eos_token_ids = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.eos_token_ids = frozenset(eos_token_ids)
        positions = int(getattr(config, "max_position_embeddings", 2048))
        model_len = min(max_model_len, positions) if max_model_len else positions  # never past RoPE's range
        kv_dtype = kv_dtype or dtype
        if kv_dtype not in (torch.int8, torch.float32, torch.bfloat16, torch.float16):
            raise EngineError(f"kv_dtype {kv_dtype} is not supported (int8, float32, bfloat16, float16)")
        if num_blocks is None:
            row = (config.head_dim + 4) if kv_dtype == torch.int8 else config.head_dim * (
                torch.finfo(kv_dtype).bits // 8)
            per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * row
            num_blocks = max(kv_cache_bytes // (per_token * block_size), -(-model_len // block_size))
            num_blocks = min(num_blocks, -(-model_len * max_num_seqs // block_size))
        model_len = min(model_len, num_blocks * block_size)
        self.limits = EngineLimits(block_size, num_blocks, model_len, max_num_seqs, max_num_batched_tokens)
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, dtype=kv_dtype,
                                  release_weights=release_weights)
        self._decode: Callable[[list[int]], str] | None = (
            (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None)
        self.spec_config = speculative or SpecConfig()
        if draft_model is not None:
            draft_vocab = getattr(getattr(draft_model, "config", None), "vocab_size", None)
            if draft_vocab != getattr(config, "vocab_size", None):
                raise EngineError(f"the draft model's vocabulary ({draft_vocab}) differs from the model's")
        self.speculator = Speculator(self.spec_config, self.runner, kv_dtype=kv_dtype, draft_model=draft_model,
                                     max_model_len=model_len)
        self._has_draft_model = draft_model is not None
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    @classmethod
    def from_dir(cls, model_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                 num_threads: int | None = None, draft_model_dir: str | Path | None = None,
                 quantization: str = "none", **kwargs: Any) -> LLMEngine:
        """Load a model directory (config.json, safetensors, tokenizer.json) or a GGUF file into a ready
        engine; ``quantization`` (none | q8_0 | q4_0) quantizes its matrices at load (`engine.quant`);
        ``draft_model_dir``: a draft model for speculative decoding (loaded the same way)."""
        from engine.model import load_model
        from engine.tokenizer import Tokenizer

        if num_threads:
            torch.set_num_threads(num_threads)
        model, config = load_model(model_dir, dtype=dtype, quantization=quantization)
        if draft_model_dir is not None:
            kwargs.setdefault("draft_model", load_model(draft_model_dir, dtype=dtype)[0])
        tokenizer = Tokenizer.from_dir(model_dir)
        kwargs.setdefault("release_weights", True)  # the engine is the model's only holder
        return cls(model, config, tokenizer=tokenizer, dtype=dtype, **kwargs)

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Seq[int], params: SamplingParams | None = None,
                    experts_per_token: int | None = None, request_id: str | None = None, *,
                    speculative: str | None = None, cache_salt: str | None = None) -> str:
        """Queue a prompt. ``speculative``: ``off``, ``auto`` (prompt lookup), ``prompt_lookup``, ``draft`` or
        ``self`` (None: the engine's default). ``cache_salt``: prefix-cache blocks are shared only between
        requests with the same salt (the gateway passes the tenant)."""
        params = params or SamplingParams()
        prompt = list(prompt_token_ids)
        if not prompt:
            raise EngineError("the prompt is empty")
        if len(prompt) >= self.limits.max_model_len:
            raise PromptTooLong(f"prompt has {len(prompt)} tokens; this model's context holds "
                                f"{self.limits.max_model_len} (prompt plus at least one output token)")
        k = self._resolve_experts(experts_per_token)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise EngineError(f"duplicate request id {rid!r}")
        proposer = self._resolve_speculative(speculative, k)
        seq = Sequence(rid, prompt, params, arrival=next(self._arrivals), experts_per_token=k,
                       cache_salt=cache_salt)
        if proposer is not None:
            seq.spec = self.speculator.new_state(proposer)
        seq.sampler_state = None if params.greedy else make_generator(params.seed)
        if self._decode is not None:
            seq.detokenizer = IncrementalDetokenizer(self._decode, prompt, params.stop)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def _resolve_experts(self, k: int | None) -> int | None:
        if self.num_experts == 0:
            if k is not None:
                raise InvalidExperts("experts_per_token is only meaningful for a mixture-of-experts model")
            return None
        if k is None:
            return self.default_experts_per_token
        if not 1 <= k <= self.num_experts:
            raise InvalidExperts(f"experts_per_token must be between 1 and {self.num_experts}")
        return k

    def _resolve_speculative(self, mode: str | None, k: int | None) -> str | None:
        """The proposer a request uses, or None for plain decoding."""
        mode = self.spec_config.default if mode is None else mode
        if mode not in MODES:
            raise InvalidSpeculative(f"speculative must be one of {', '.join(MODES)}")
        if mode == "off":
            return None
        if mode == "auto":
            return "prompt_lookup"
        if mode == "self":
            if self.num_experts == 0:
                raise InvalidSpeculative("self-speculation needs a mixture-of-experts model")
            if (k or 0) <= 1:
                return None  # already at one expert per token: nothing cheaper to draft with
        if mode == "draft" and not self._has_draft_model:
            raise InvalidSpeculative("this engine has no draft model")
        return mode

    def abort(self, request_id: str) -> bool:
        """Cancel a request (waiting or running) and free its blocks; False if unknown/finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self.speculator.release(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._seqs)

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        drafting = self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if out.is_empty:
            if not out.preempted and self.scheduler.has_unfinished():
                raise EngineError("the KV cache is too small for the next waiting request")
            return []
        logits = self.runner.execute(out.scheduled)
        sampling = [s for s in out.scheduled if s.samples]
        if not sampling:
            self.scheduler.advance(out)
            return []
        rows: list[int] = []
        row = 0
        for s in sampling:
            rows.append(row)
            row += 1 + s.num_spec
        plain = [i for i, s in enumerate(sampling) if not s.num_spec]
        emitted: list[tuple[list[int], list[TokenLogprob | None]]] = [([], [])] * len(sampling)
        if plain:
            seqs = [sampling[i].seq for i in plain]
            plain_logits = logits if len(plain) == len(sampling) and row == len(sampling) else \
                logits[[rows[i] for i in plain]]
            tokens, logprobs = sample(plain_logits, [q.params for q in seqs], [q.sampler_state for q in seqs],
                                      [self._suppressed(q, 0) for q in seqs],
                                      self.runner.last_argmax if plain_logits is logits else None)
            for i, t, lp in zip(plain, tokens, logprobs, strict=True):
                emitted[i] = ([t], [lp])
        accepted: dict[Sequence, int] = {}
        argmax = self.runner.last_argmax
        for i, s in enumerate(sampling):
            if s.num_spec:
                end = rows[i] + 1 + s.num_spec
                emitted[i] = self.speculator.verify(s, logits[rows[i]:end], self._suppressed,
                                                    None if argmax is None else argmax[rows[i]:end])
                accepted[s.seq] = len(emitted[i][0]) - 1
        self.scheduler.advance(out, accepted)
        self.speculator.record(out.scheduled, accepted, time.perf_counter() - start - drafting)
        return [self._after_tokens(s.seq, toks, lps) for s, (toks, lps) in zip(sampling, emitted, strict=True)]

    def _suppressed(self, seq: Sequence, offset: int) -> tuple[int, ...]:
        """Ids the ``offset``-th next token of ``seq`` may not be (end of sequence before ``min_tokens``)."""
        if seq.num_output_tokens + offset < seq.params.min_tokens:
            return tuple(self.eos_token_ids | set(seq.params.stop_token_ids))
        return ()

    def _after_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob | None]
                      ) -> RequestOutput:
        """Append the step's tokens (one, or several after a verified draft) and apply the stop rules to each;
        tokens after a stop are dropped."""
        p = seq.params
        det: IncrementalDetokenizer | None = seq.detokenizer
        reason: str | None = None
        new: list[int] = []
        new_lps: list[TokenLogprob] = []
        for token, logprob in zip(tokens, logprobs, strict=True):
            seq.append_token(token, logprob)
            new.append(token)
            if logprob is not None:
                new_lps.append(logprob)
            stop_token = token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos)
            if stop_token or (det is not None and det.add_token(token)):
                reason = "stop"
            elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or \
                    seq.num_tokens >= self.limits.max_model_len:
                reason = "length"
            if reason is not None:
                break
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self._seqs[seq.request_id]
            self.speculator.release(seq)
            if det is not None:
                det.flush()
        finished = reason is not None
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new,
            new_text=det.take_delta(finished) if det is not None else "",
            new_logprobs=new_lps,
            finished=finished, finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            text=det.text if det is not None else "",
            output_token_ids=seq.output_token_ids if finished else [],
        )

    # -- offline ------------------------------------------------------------------------------
    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 experts_per_token: int | None = None, *, speculative: str | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching); final outputs in prompt order."""
        plist: list[SamplingParams] = (
            [params or SamplingParams()] * len(prompts) if params is None or isinstance(params, SamplingParams)
            else list(params))
        ids = [self.add_request(p, sp, experts_per_token, speculative=speculative, cache_salt=cache_salt)
               for p, sp in zip(prompts, plist, strict=True)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]
