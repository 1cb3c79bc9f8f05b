"""Weight-only quantization in ggml's block formats, in plain torch: the formats, the quantizers, the oracle.

Two formats, stored byte for byte as ggml/GGUF store them (so a GGUF tensor of either type is used as it is,
never requantized), each over blocks of 32 consecutive elements of a weight row ``W[n, 32 b : 32 b + 32]``:

- ``q8_0``: a fp16 scale ``d`` then 32 int8 ``q``; ``w = d * q``; quantized with ``d = amax / 127``;
- ``q4_0``: a fp16 scale ``d`` then 16 bytes of nibbles (element j in the low nibble of byte j, element
  j + 16 in its high nibble); ``w = d * (q - 8)``; quantized with ``d = max / -8`` where ``max`` is the
  element of largest magnitude, ``q = min(15, trunc(w / d + 8.5))`` (llama.cpp's reference quantizers).

A matrix ``[N, K]`` (or a stack ``[E, N, K]``) becomes uint8 ``[N, K / 32 * block_bytes]`` (``[E, ...]``).

`quantize_model(model, scheme)` applies a scheme at load: every matrix the model multiplies by (attention
q/k/v and o, dense MLPs, stacked experts, shared experts, the LM head) whose rows split into whole blocks
is quantized, and its parameter is overwritten with the dequantized values, so the plain model computes the
quantized model (the fallback where the native kernels are absent); the blocks are kept in
``model.quantized`` (`QuantizedWeights`), where the native backend takes them for its kernels. Under
``q4_0`` the LM head is kept at ``q8_0`` (as llama.cpp keeps its output matrix at higher precision).
Routers, norms and embedding lookups are not quantized (a tied embedding is the LM head's matrix).

The native kernels also quantize each activation row to int8 per 32-block (fp32 scale ``amax / 127``,
round half to even) and do exact integer dot products; `quantize_activations` and `reference_linear` are
that computation in torch, the oracle the kernels are tested against.

Pure torch: must not import the model, engine.native, or anything outside torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

BLOCK = 32
SCHEMES = ("none", "q8_0", "q4_0")
FORMATS = ("q8_0", "q4_0")
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}


class QuantizationError(ValueError):
    """An unknown scheme, or a matrix that cannot be quantized in it."""


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise QuantizationError(f"unknown quantization {scheme!r}; supported: {', '.join(SCHEMES)}")
    return scheme


def _blocks(w: torch.Tensor) -> torch.Tensor:
    if w.shape[-1] % BLOCK:
        raise QuantizationError(f"rows of {w.shape[-1]} elements do not split into {BLOCK}-element blocks")
    return w.detach().float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)


def _scale_bytes(d: torch.Tensor) -> torch.Tensor:
    return d.to(torch.float16).unsqueeze(-1).view(torch.uint8)  # [..., nb, 2], little-endian fp16


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's ``roundf`` (ties away from zero), without the fp32 rounding of ``floor(|v| + 0.5)``."""
    a = v.abs()
    whole = torch.floor(a)
    return torch.sign(v) * (whole + torch.floor(2 * (a - whole)))


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] -> uint8 [..., K / 32 * 34] (llama.cpp's ``quantize_row_q8_0_ref``)."""
    v = _blocks(w)
    d = v.abs().amax(dim=-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = _round_half_away(v * inv[..., None]).to(torch.int8).view(torch.uint8)
    return torch.cat([_scale_bytes(d), q], dim=-1).reshape(*w.shape[:-1], -1)


def quantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] -> uint8 [..., K / 32 * 18] (llama.cpp's ``quantize_row_q4_0_ref``)."""
    v = _blocks(w)
    idx = v.abs().argmax(dim=-1, keepdim=True)
    d = v.gather(-1, idx).squeeze(-1) / -8.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc(v * inv[..., None] + 8.5), 0, 15).to(torch.uint8)
    nibbles = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return torch.cat([_scale_bytes(d), nibbles], dim=-1).reshape(*w.shape[:-1], -1)


def quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "q8_0":
        return quantize_q8_0(w)
    if fmt == "q4_0":
        return quantize_q4_0(w)
    raise QuantizationError(f"unknown block format {fmt!r}")


def dequantize(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 [..., nb * block_bytes] -> fp32 [..., nb * 32]."""
    if fmt not in BLOCK_BYTES:
        raise QuantizationError(f"unknown block format {fmt!r}")
    size = BLOCK_BYTES[fmt]
    if blocks.dtype != torch.uint8 or blocks.shape[-1] % size:
        raise QuantizationError(f"{fmt} data must be uint8 rows of whole {size}-byte blocks")
    b = blocks.reshape(*blocks.shape[:-1], blocks.shape[-1] // size, size)
    d = b[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
    if fmt == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
    else:
        nib = b[..., 2:]
        q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).float() - 8.0
    return (d * q).reshape(*blocks.shape[:-1], -1)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activation quantizer: x [M, K] -> (scales fp32 [M, K / 32], int8 [M, K])."""
    v = _blocks(x)
    d = v.abs().amax(dim=-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(v * inv[..., None]).to(torch.int8)
    return d, q.reshape(x.shape)


def activations_as_seen(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels use it: quantized per block and scaled back, in float64."""
    d, q = quantize_activations(x)
    return (q.double().reshape(*d.shape, BLOCK) * d.double()[..., None]).reshape(x.shape)


def reference_linear(x: torch.Tensor, blocks: torch.Tensor, fmt: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of the quantized kernels: x [M, K] quantized as the kernels do, times the dequantized weight,
    in float64 -> fp32 [M, N]."""
    y = activations_as_seen(x) @ dequantize(blocks, fmt).double().T
    if bias is not None:
        y = y + bias.double()
    return y.float()


@dataclass(frozen=True)
class QuantizedMatrix:
    """One matrix [N, K] or stack [E, N, K] in a block format: ``data`` uint8 [(E,) N, K / 32 * block_bytes]."""

    fmt: str
    data: torch.Tensor
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise QuantizationError(f"unknown block format {self.fmt!r}")
        k = self.shape[-1]
        expected = (*self.shape[:-1], k // BLOCK * BLOCK_BYTES[self.fmt])
        if k % BLOCK or tuple(self.data.shape) != expected or self.data.dtype != torch.uint8:
            raise QuantizationError(f"{self.fmt} data {tuple(self.data.shape)} does not hold a {self.shape} matrix")

    @classmethod
    def of(cls, w: torch.Tensor, fmt: str) -> QuantizedMatrix:
        return cls(fmt, quantize(w, fmt).contiguous(), tuple(w.shape))

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.fmt)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class QuantizedWeights:
    """A model's quantized matrices, looked up by its parameter (the parameter holds the dequantized values)."""

    def __init__(self, scheme: str) -> None:
        self.scheme = check_scheme(scheme)
        self._by_param: dict[int, tuple[torch.Tensor, QuantizedMatrix]] = {}

    def add(self, param: torch.Tensor, matrix: QuantizedMatrix) -> None:
        """Record ``matrix`` as ``param``'s blocks and write its dequantized values into ``param``."""
        if tuple(param.shape) != matrix.shape:
            raise QuantizationError(f"blocks of a {matrix.shape} matrix for a {tuple(param.shape)} parameter")
        with torch.no_grad():
            param.copy_(matrix.dequantize().reshape(param.shape))
        self._by_param[id(param)] = (param, matrix)

    def get(self, param: torch.Tensor) -> QuantizedMatrix | None:
        found = self._by_param.get(id(param))
        return None if found is None or found[0] is not param else found[1]

    def __len__(self) -> int:
        return len(self._by_param)

    def formats(self) -> list[str]:
        return sorted({m.fmt for _, m in self._by_param.values()})

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for _, m in self._by_param.values())


def target_matrices(model: Any) -> list[tuple[str, torch.Tensor]]:
    """(role, parameter) for every matrix a forward of ``model`` (a `CausalLM`) multiplies by, each once; role is
    ``"lm_head"`` or ``"layer"``."""
    found: list[tuple[str, torch.Tensor]] = []

    def mlp_matrices(mlp: Any) -> Iterable[torch.Tensor]:
        if hasattr(mlp, "experts"):
            yield mlp.experts.gate_up_proj
            yield mlp.experts.down_proj
            if mlp.shared_expert is not None:
                yield from mlp_matrices(mlp.shared_expert)
        else:
            yield mlp.gate_up_proj.weight
            yield mlp.down_proj.weight

    for layer in model.model.layers:
        attn = layer.self_attn
        found += [("layer", w) for w in (attn.qkv_proj.weight, attn.o_proj.weight, *mlp_matrices(layer.mlp))]
    found.append(("lm_head", model.lm_head.weight))
    return found


def quantize_model(model: Any, scheme: str) -> QuantizedWeights | None:
    """Quantize ``model`` (a fp32 `CausalLM`) in place with ``scheme`` (see the module docstring); returns the
    blocks, also set as ``model.quantized`` (None for ``"none"``). Matrices whose rows do not split into
    32-element blocks stay as they are. Matrices already in ``model.quantized`` (a GGUF's blocks) are kept."""
    if check_scheme(scheme) == "none":
        return getattr(model, "quantized", None)
    existing = getattr(model, "quantized", None)
    weights = existing if isinstance(existing, QuantizedWeights) else QuantizedWeights(scheme)
    for role, w in target_matrices(model):
        if w.shape[-1] % BLOCK or weights.get(w) is not None:
            continue
        if w.dtype != torch.float32:
            raise QuantizationError("quantization is applied to a fp32 model (load it with dtype=torch.float32)")
        fmt = "q8_0" if role == "lm_head" else scheme
        weights.add(w, QuantizedMatrix.of(w, fmt))
    model.quantized = weights
    return weights
