"""Inference-only CPU matmul dispatch: `linear(x, weight)` picks the faster GEMM library per shape.

On CPU, PyTorch's fp32 `F.linear` goes to MKL. For the small-M GEMMs of MoE decode and prefill (a few tokens
per expert, M = 2..64) oneDNN's `mkldnn::_linear_pointwise` reads the same column-major weights 1.3-2x
faster on the CPUs measured (`tiergate bench engine`); for M = 1 (GEMV) and tiny weights MKL is as fast and
has less per-call overhead. Both are plain fp32 GEMMs (no reduced-precision accumulation): results agree to
float rounding (~1e-6 relative).

The oneDNN path has no autograd formula, so it is used only when no gradient is wanted (inference mode or
`torch.no_grad`); the training path always gets `F.linear`. Set `TIERGATE_ENGINE_ONEDNN=0` to turn it off.

Must not import the model, the scheduler, or anything outside torch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# Below these sizes MKL's lower per-call overhead wins (measured: a [8, 768] router costs 2.4 us with MKL,
# 13 us with oneDNN; a [1, 768] x [768, 1280] GEMV is as fast on either).
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
