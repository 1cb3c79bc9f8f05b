"""Upstream models and the tiers that use them: prices, engine knobs, fallbacks.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from gateway.money import TokenCounts, rate, round_nanos
from gateway.settings.base import _Strict


class Price(_Strict):
    """USD per one million tokens (as configured); costs come out in integer nano-USD."""

    input: float = Field(0.0, ge=0)
    cached_input: float | None = Field(None, ge=0)
    output: float = Field(0.0, ge=0)

    def nanos(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """What these tokens cost, in nano-USD. Each count is multiplied by its price as the
        exact decimal it was configured as (``gateway.money.rate``), the products are summed
        exactly, and the sum is rounded once, half-up, to a whole nano-USD. Cached tokens are
        part of ``prompt_tokens`` and cost ``cached_input`` (``input`` when unset)."""
        cached_price = self.input if self.cached_input is None else self.cached_input
        uncached = max(prompt_tokens - cached_tokens, 0)
        return round_nanos(uncached * rate(self.input) + cached_tokens * rate(cached_price)
                           + completion_tokens * rate(self.output))

    def cost_nanos(self, usage: TokenCounts) -> int:
        """The cost of one call's ``usage`` in nano-USD (see ``nanos``)."""
        return self.nanos(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)


SpeculativeMode = Literal["off", "auto", "prompt_lookup", "draft", "self"]


class EngineKnobs(_Strict):
    experts_per_token: int | None = Field(None, ge=1)
    thinking_budget_tokens: int | None = Field(None, ge=0)
    # speculative decoding for this tier on the bundled engine (None: the engine's default, off);
    # a request's ``tiergate.speculative`` overrides it. draft needs the model's ``draft_model``.
    speculative: SpeculativeMode | None = None


class ModelEngineSettings(_Strict):
    """How the bundled engine loads a ``provider: local`` model. ``quantization``: the weight format of its
    matrices, applied at load from a bf16/fp32 checkpoint (``q8_0``: int8, ``q4_0``: 4-bit, in 32-element
    blocks with a scale each, run on the engine's int8 kernels; ``none``: as stored). A GGUF file's Q8_0/Q4_0
    tensors are used as they are whatever this says."""

    quantization: Literal["none", "q8_0", "q4_0"] = "none"


class ModelSettings(_Strict):
    """One upstream model. ``provider``: openai (any OpenAI-compatible server),
    litellm (any litellm provider string), local (the bundled engine)."""

    provider: Literal["openai", "litellm", "local"]
    model: str = Field(..., min_length=1, description="upstream model name / litellm string / local dir")
    api_base: str | None = None
    api_key_env: str | None = None
    timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(2, ge=0, le=10)
    context_window: int = Field(8192, gt=0)
    price: Price = Price()
    # Output cap for this model when it is called by its own name (a tier's max_output_tokens
    # applies when it serves a tier); None: the upstream's own limit, and budget holds assume
    # the whole context window.
    max_output_tokens: int | None = Field(None, gt=0)
    # Non-OpenAI sampling parameters the upstream accepts (vLLM/SGLang do): forwarded when a
    # client sends them; refused with a 400 for models that do not list them.
    extra_params: tuple[Literal["top_k", "min_p", "repetition_penalty"], ...] = ()
    # Let clients send http(s) image URLs, which the upstream (or litellm, on this host) fetches.
    # Off: images must be inline data: URLs (a URL could point into the operator's network).
    remote_media: bool = False
    # provider local: a draft model directory (same tokenizer) for speculative decoding with ``draft``
    draft_model: str | None = Field(None, min_length=1)
    # provider local: the KV cache's element type; int8 stores K/V rows as int8 with a scale per row
    # (about 3.6x the context per byte at head_dim 32; small quantization error)
    kv_dtype: Literal["auto", "int8"] = "auto"
    # provider: local only: how the engine loads the weights (ModelEngineSettings)
    engine: ModelEngineSettings = ModelEngineSettings()

    @model_validator(mode="after")
    def _needs_base(self) -> ModelSettings:
        if self.provider == "openai" and not self.api_base:
            raise ValueError("provider 'openai' needs api_base")
        return self

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class TierSettings(_Strict):
    model: str
    fallbacks: tuple[str, ...] = ()
    price: Price | None = None  # overrides the model's price for this tier
    engine: EngineKnobs = EngineKnobs()
    max_output_tokens: int = Field(1024, gt=0)
