"""The engine's native fast backend: fp32 CPU inference on small C kernels, built from a plain model.

    backend = prepare(model, release=True)   # packs the weights once; see engine.native.packing
    logits = backend.forward(input_ids, positions, ctx, kv_caches, experts_per_token, last_token_indices)

Layout:

- ``tg_kernels.c`` (+ ``tg_step.c``, the whole decode step on one thread team) / ``build.py``: the kernels and
  their cached ``-march=native`` build;
- ``ops``: the C entry points (ctypes), ``available()`` / ``reason()``;
- ``threads``: whether a one-call decode step runs on the thread team or on one thread (measured);
- ``packing``: which matrices are packed (fp32 or bf16 panels, or the model's Q8_0 / Q4_0 blocks from
  `engine.quant`) and the release of the model's copies;
- ``layers``: which layer kinds the one-call decode kernel covers, and its layer specs;
- ``step``: a plain decode step in one call from token ids to logits (embedding, RoPE table, LM head in C);
- ``backend``: ``supports``, ``prepare`` and ``NativeBackend`` (one-call decode, per-op layers otherwise).

Only the model runner (`engine.runner`) imports this package (an import-linter contract says so); the
model modules are pure torch and know nothing of it. Names are resolved lazily, so that
``python -m engine.native.build`` needs nothing but the standard library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.native.backend import NativeBackend, prepare, supports
    from engine.native.ops import available, reason

_EXPORTS = {
    "NativeBackend": "engine.native.backend",
    "prepare": "engine.native.backend",
    "supports": "engine.native.backend",
    "available": "engine.native.ops",
    "reason": "engine.native.ops",
}

__all__ = ["NativeBackend", "available", "prepare", "reason", "supports"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.native' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
