"""tiergate's local sparse-MoE inference engine (PyTorch). Public API.

The gateway uses only the names exported here. Exports are resolved lazily so that
importing a light submodule (``engine.config``) does not pull in torch. This package never
imports the gateway, the classifier, or anything web/db.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine, EngineDeadError
    from engine.config import ModelConfig
    from engine.engine import EngineError, InvalidExperts, LLMEngine, PromptTooLong, RequestOutput
    from engine.model import CausalLM, load_model
    from engine.sampling_params import SamplingParams, TokenLogprob
    from engine.tokenizer import Tokenizer

_EXPORTS = {
    "AsyncLLMEngine": "engine.async_engine",
    "EngineDeadError": "engine.async_engine",
    "EngineError": "engine.engine",
    "InvalidExperts": "engine.engine",
    "LLMEngine": "engine.engine",
    "PromptTooLong": "engine.engine",
    "RequestOutput": "engine.engine",
    "SamplingParams": "engine.sampling_params",
    "TokenLogprob": "engine.sampling_params",
    "CausalLM": "engine.model",
    "load_model": "engine.model",
    "ModelConfig": "engine.config",
    "Tokenizer": "engine.tokenizer",
}

__all__ = [
    "AsyncLLMEngine", "CausalLM", "EngineDeadError", "EngineError", "InvalidExperts", "LLMEngine", "ModelConfig",
    "PromptTooLong", "RequestOutput", "SamplingParams", "TokenLogprob", "Tokenizer", "load_model",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
