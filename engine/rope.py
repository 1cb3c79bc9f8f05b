"""Rotary position embeddings with the HF scaling variants: default, linear, dynamic (NTK), llama3, yarn.

`inv_freq` follows `transformers.modeling_rope_utils` exactly; cos/sin are computed per forward from the
positions actually present (no max-length table, so a 128k-context config costs nothing up front).
Dynamic NTK matches HF's no-cache semantics: frequencies are rescaled from the largest position in the
forward pass when it exceeds `max_position_embeddings`, and are the default ones below it.

Must not import the model, the attention code, or anything outside torch and engine.config.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import RopeConfig


def compute_inv_freq(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [head_dim // 2] fp32 on CPU, attention scaling applied to cos/sin)."""
    dim = head_dim
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if rope.rope_type == "dynamic":
        length = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = base * ((rope.factor * length / max_position_embeddings) - (rope.factor - 1)) ** (
            dim / (dim - 2)
        )
    inv_freq = 1.0 / (base**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, max_position_embeddings)
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or 8192
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    orig = rope.original_max_position_embeddings or max_position_embeddings

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs
    ) * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) [*positions.shape, head_dim] for a batch of absolute positions."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq, scaling = compute_inv_freq(rope, head_dim, max_position_embeddings)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.rope.rope_type == "dynamic":
            seq_len = int(positions.max()) + 1 if positions.numel() else 0
            if seq_len > self.max_position_embeddings:
                inv_freq, _ = compute_inv_freq(
                    self.rope, self.head_dim, self.max_position_embeddings, seq_len
                )
                inv_freq = inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv_freq  # [..., D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
        cos = emb.cos()
        sin = emb.sin()
        if self.attention_scaling != 1.0:
            cos = cos * self.attention_scaling
            sin = sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, H, D]; cos/sin: [..., T, D] (broadcast over heads). HF rotate-half convention."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
