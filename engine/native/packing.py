"""The model's weight matrices in the kernels' panel layout, packed once when the backend is prepared.

Every matrix a forward multiplies by — attention q/k/v and o, dense MLPs, the stacked experts (both
stacks or neither), a shared expert, the LM head (or the embedding table it is tied to) — is repacked
with `ops.pack` when it has at least 16 output rows (a panel holds 64; smaller products, such as a
shared expert's one-logit gate, stay torch). Routers, norms and an untied embedding table stay as they
are. When every packed matrix is exact in bf16 (a bf16 checkpoint loaded as fp32) the panels hold bf16:
half the bytes per step, the same products (``TIERGATE_ENGINE_PANELS=fp32``, read when a model is packed,
keeps them fp32: for benchmarks of the fp32 format). A matrix the model holds quantized
(``model.quantized``, see `engine.quant`: a ``engine.quantization`` scheme applied at load, or a GGUF's
Q8_0 / Q4_0 tensors) is taken as its Q8_0 / Q4_0 blocks instead, for the kernels' int8 products.

With ``release`` the model's own copy of each packed matrix is given back, so the weights are held once:
the parameter keeps its shape but holds one zero (broadcast), every parameter stops requiring
gradients, and calling the model (or any module that owns or contains a released matrix) raises rather
than computing with the released storage. The tied embedding keeps its storage (tokens are looked up in
it by row).

Must not import the scheduler, the runner, or anything web/db; torch, the engine's model types and quant
blocks, and engine.native.ops only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from engine.model import CausalLM, DecoderLayer
from engine.moe import DenseMLP, SparseMoeBlock
from engine.native import ops
from engine.quant import BLOCK, QuantizedMatrix, QuantizedWeights

MIN_ROWS = 16  # fewer output rows than this: not worth a 64-row panel

RELEASED = (
    "this weight was repacked for inference by the engine's native backend and its original storage "
    "released: the model now runs only through that backend (build the engine with release_weights=False, "
    "or load the model again, to run or train it on its own)"
)


def holds_values(weight: torch.Tensor) -> bool:
    """False for a matrix whose storage was released (it broadcasts one element over its shape)."""
    return weight.numel() <= 1 or weight.untyped_storage().nbytes() >= weight.numel() * weight.element_size()


def _mlp_matrices(mlp: SparseMoeBlock | DenseMLP) -> Iterator[torch.Tensor]:
    if isinstance(mlp, DenseMLP):
        yield from (mlp.gate_up_proj.weight, mlp.down_proj.weight)
        return
    stacks = (mlp.experts.gate_up_proj, mlp.experts.down_proj)
    if all(s.shape[-2] >= MIN_ROWS for s in stacks):
        yield from stacks  # both or neither: the fused MoE kernel takes both packed
    if mlp.shared_expert is not None:
        yield from _mlp_matrices(mlp.shared_expert)


def packable_matrices(model: CausalLM) -> list[torch.Tensor]:
    """The matrices `PackedWeights` packs, each once (a tied LM head is the embedding table)."""
    found: list[torch.Tensor] = []
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        found += [attn.qkv_proj.weight, attn.o_proj.weight, *_mlp_matrices(layer.mlp)]
    found.append(model.lm_head.weight)
    return [w for w in found if w.shape[-2] >= MIN_ROWS]


class PackedWeights:
    """Packed copies of a model's matrices, looked up by the model's parameter."""

    def __init__(self, model: CausalLM, release: bool) -> None:
        if not ops.available():
            raise RuntimeError(f"the native kernels are not available: {ops.reason()}")
        matrices = packable_matrices(model)
        if _refuse in model._forward_pre_hooks.values() or not all(holds_values(w) for w in matrices):
            raise ValueError("this model's weights were released to an earlier native backend; load it again")
        quantized = getattr(model, "quantized", None)
        blocks = {id(w): q for w in matrices if isinstance(quantized, QuantizedWeights)
                  and (q := quantized.get(w)) is not None}
        _one_format_per_expert_pair(model, blocks)
        plain = [w for w in matrices if id(w) not in blocks]
        with torch.no_grad():
            # bf16 panels when that loses nothing (a bf16 checkpoint loaded as fp32): half the bytes per step
            self.bf16 = bool(plain) and os.environ.get("TIERGATE_ENGINE_PANELS", "auto") != "fp32" and all(
                torch.equal(w, w.bfloat16().float()) for w in plain)
            self._packed = {id(w): ops.pack(w.detach(), bf16=self.bf16) for w in plain}
            self._packed.update({key: ops.pack_blocks(q.data, q.fmt) for key, q in blocks.items()})
        self._matrices = matrices  # keeps the ids above valid
        self.released = False
        if release:
            self._release(model, matrices)

    def get(self, weight: torch.Tensor) -> ops.Packed | None:
        """The packed copy of ``weight``, or None where it stays a torch matrix."""
        return self._packed.get(id(weight))

    @property
    def element(self) -> str:
        """The packed matrices' formats, e.g. ``"bf16"``, ``"q8_0"`` or ``"q4_0 + q8_0"`` (most bytes first)."""
        sizes: dict[str, int] = {}
        for p in self._packed.values():
            sizes[p.format_name] = sizes.get(p.format_name, 0) + p.data.numel() * p.data.element_size()
        return " + ".join(sorted(sizes, key=lambda f: -sizes[f])) or ("bf16" if self.bf16 else "fp32")

    @property
    def quantized(self) -> bool:
        return any(p.quantized for p in self._packed.values())

    def packed(self) -> list[ops.Packed]:
        """Every packed matrix (stacks as one), in the model's order."""
        return list(self._packed.values())

    def _release(self, model: CausalLM, matrices: list[torch.Tensor]) -> None:
        embedding = model.model.embed_tokens.weight
        released = {id(w) for w in matrices if w is not embedding}
        owners: set[str] = set()
        with torch.no_grad():
            for name, module in model.named_modules():
                for p in module.parameters(recurse=False):
                    if id(p) in released:
                        p.data = torch.zeros(1, dtype=p.dtype, device=p.device).expand(p.shape)
                        owners.add(name)
        model.requires_grad_(False)  # an inference model now: nothing in it can be trained
        if isinstance(getattr(model, "quantized", None), QuantizedWeights):
            model.quantized = None  # its blocks were copied into the packed buffers: hold them once
        guarded = {".".join(parts[:i]) for name in owners for parts in [name.split(".")]
                   for i in range(len(parts) + 1)}  # each owner and every module around it
        for name, module in model.named_modules():
            if name in guarded:
                module.register_forward_pre_hook(_refuse)
        self.released = True


def _one_format_per_expert_pair(model: CausalLM, blocks: dict[int, QuantizedMatrix]) -> None:
    """The fused MoE kernel takes both expert stacks in one format: where a checkpoint mixes them (a GGUF with
    Q4_0 gate/up and Q8_0 or F16 down experts), both are held as Q8_0 blocks of their values, or, where a
    stack's rows do not split into blocks, both stay panels."""
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        mlp = layer.mlp
        if not isinstance(mlp, SparseMoeBlock):
            continue
        pair = (mlp.experts.gate_up_proj, mlp.experts.down_proj)
        found = [blocks.get(id(w)) for w in pair]
        formats = {q.fmt if q is not None else None for q in found}
        if len(formats) == 1:
            continue
        if all(w.shape[-1] % BLOCK == 0 for w in pair):
            with torch.no_grad():
                for w in pair:
                    blocks[id(w)] = QuantizedMatrix.of(w.detach(), "q8_0")
        else:
            for w in pair:
                blocks.pop(id(w), None)


def _refuse(module: nn.Module, args: Any) -> None:
    raise RuntimeError(RELEASED)
