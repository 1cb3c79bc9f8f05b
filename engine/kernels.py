"""Inference-only CPU matmul dispatch: `linear(x, weight)` picks the faster GEMM library per shape.

On CPU, PyTorch's fp32 `F.linear` goes to MKL. For the small-M GEMMs of MoE decode and prefill (a few tokens
per expert, M = 2..64) oneDNN's `mkldnn::_linear_pointwise` runs the same column-major weights much faster on
the AMD EPYC development machine: figure (c) of `tiergate bench engine` shows it, and the same command with
`TIERGATE_ENGINE_ONEDNN=0` gives the MKL-only baseline. For M = 1 (GEMV) and tiny weights MKL is as fast and
has less per-call overhead. Both are plain fp32 GEMMs (no reduced-precision accumulation); results agree to
float rounding (tests/engine/test_kernels.py checks 1e-5 relative and HF parity).

The oneDNN path has no autograd formula, so it is used only when no gradient is wanted (inference mode or
`torch.no_grad`); the training path always gets `F.linear`. Set `TIERGATE_ENGINE_ONEDNN=0` to turn it off.

This is the plain-torch model's matmul; the native fast backend (`engine.native`) runs its own packed
products and never comes through here.

Must not import the model, the scheduler, engine.native, or anything outside torch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# Below these sizes MKL wins: a GEMV reads the weights as fast on either library, and oneDNN's per-call
# overhead dominates a router-sized product.
MIN_ROWS = 2
MIN_WEIGHT_NUMEL = 1 << 16


def _onednn_available() -> bool:
    if os.environ.get("TIERGATE_ENGINE_ONEDNN", "1") == "0":
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_available()


def use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `linear` would send this product to oneDNN."""
    return (
        _ONEDNN
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] >= MIN_ROWS
        and weight.numel() >= MIN_WEIGHT_NUMEL
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [..., K], weight [N, K] (any strides) -> [..., N]."""
    if use_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)

