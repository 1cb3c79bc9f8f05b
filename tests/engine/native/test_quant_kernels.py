"""The quantized (Q8_0 / Q4_0) kernels against their torch oracle, on one thread and on two.

The oracle (`engine.quant.reference_linear`) quantizes the activation rows as the kernels do and multiplies
by the dequantized weight in float64: the kernels' integer dot products are exact, so only the fp32
scaling and summation order differ. The block quantizers are checked byte for byte against the `gguf`
package's (llama.cpp's reference quantizers); the fused MoE, the one-call decode step and a whole engine
are checked on quantized weights; the plain-torch fallback runs the same quantized model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import quant
from engine.engine import LLMEngine
from engine.model import load_model
from engine.moe import ExpertCount, route
from engine.native import ops
from engine.native.packing import PackedWeights
from engine.runner import TorchBackend, pick_backend
from engine.sampling_params import SamplingParams
from tests.engine.native.test_decode_layers import KINDS, _decode_step, _model

FORMATS = ("q8_0", "q4_0")
DEMO = "engine/models/demo-moe"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_quantizers_match_llama_cpp_byte_for_byte(fmt: str) -> None:
    import gguf

    w = torch.randn(37, 256, generator=_gen(1)) * torch.linspace(0.01, 3, 256)
    w[3, :32] = 0.0  # an all-zero block: scale 0
    w[4, 5] = 40.0  # an outlier
    kind = gguf.GGMLQuantizationType.Q8_0 if fmt == "q8_0" else gguf.GGMLQuantizationType.Q4_0
    theirs = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w.numpy(), kind)))
    ours = quant.quantize(w, fmt)
    assert torch.equal(ours, theirs)
    back = torch.from_numpy(gguf.quants.dequantize(theirs.numpy(), kind).copy())
    torch.testing.assert_close(quant.dequantize(ours, fmt), back, rtol=0, atol=0)
    # within half a step of each block's scale (q4_0: a whole step at the clipped top), plus the fp16 rounding
    # of the scale (up to 2^-11 of it, times the largest level)
    levels = 127 if fmt == "q8_0" else 8
    step = w.reshape(37, 8, 32).abs().amax(-1, keepdim=True) / levels
    err = (quant.dequantize(ours, fmt) - w).reshape(37, 8, 32).abs()
    assert bool((err <= step * ((0.5 if fmt == "q8_0" else 1.0) + levels / 2048) * 1.001 + 1e-7).all())


def test_activation_quantizer_is_the_oracle_s() -> None:
    x = torch.randn(9, 160, generator=_gen(2)) * 3
    x[1, :32] = 0.0
    d, q = ops.quantize_rows_q8(x)
    d_ref, q_ref = quant.quantize_activations(x)
    assert torch.equal(d, d_ref) and torch.equal(q, q_ref)
    assert int(q.abs().max()) == 127


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 768, 2560), (1, 32, 16), (3, 96, 37), (5, 256, 130), (16, 64, 200),
                                           (64, 128, 96)])
def test_quantized_linear_equals_the_dequantize_then_matmul_oracle(fmt: str, m: int, k: int, n: int,
                                                                    threads: int) -> None:
    x = torch.randn(m, k, generator=_gen(m + k))
    w = torch.randn(n, k, generator=_gen(n)) * 0.1
    b = torch.randn(n, generator=_gen(k))
    blocks = quant.quantize(w, fmt)
    packed = ops.pack_blocks(blocks, fmt)
    assert packed.quantized and packed.n == n and packed.k == k
    assert packed.data.numel() == -(-n // 16) * 16 * k // 32 * (34 if fmt == "q8_0" else 18)  # whole 16-row groups
    for bias in (None, b):
        got = ops.linear(x, packed, bias)
        ref = quant.reference_linear(x, blocks, fmt, bias)
        scale = float(ref.abs().max())
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * scale)
    # and within int8 activation rounding of the plain product with the dequantized weight
    plain = F.linear(x, quant.dequantize(blocks, fmt))
    assert float((got - b - plain).norm() / plain.norm()) < 0.02


def _ggml_rows(packed: ops.Packed, fmt: str) -> torch.Tensor:
    """ggml's row-major blocks back from the kernels' 16-row groups (tg_pack_q's layout, read independently):
    per group and block, 16 fp16 scales, then the quants four bytes per row at a time (Q8_0: q + 128)."""
    size = 34 if fmt == "q8_0" else 18
    nb, groups = packed.k // 32, -(-packed.n // 16)
    data = packed.data.reshape(groups, nb, 16 * size)
    scales = data[:, :, :32].reshape(groups, nb, 16, 2)
    quants = data[:, :, 32:].reshape(groups, nb, (size - 2) // 4, 16, 4).permute(0, 1, 3, 2, 4)
    quants = quants.reshape(groups, nb, 16, size - 2)
    if fmt == "q8_0":
        quants = quants ^ 0x80
    blocks = torch.cat([scales, quants], dim=-1).permute(0, 2, 1, 3).reshape(groups * 16, nb * size)
    assert not blocks[packed.n:].reshape(-1, size)[:, :2].any()  # padding rows: zero scales
    return blocks[: packed.n]


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_blocks_hold_ggml_s_bytes_in_16_row_groups(fmt: str) -> None:
    for n in (16, 37):
        blocks = quant.quantize(torch.randn(n, 96, generator=_gen(n)), fmt)
        assert torch.equal(_ggml_rows(ops.pack_blocks(blocks, fmt), fmt), blocks)
    stack = quant.quantize(torch.randn(3, 20, 64, generator=_gen(7)), fmt)
    packed = ops.pack_blocks(stack, fmt)
    for e in range(3):
        assert torch.equal(_ggml_rows(ops.Packed(packed.data[e], 20, 64, fmt=packed.fmt), fmt), stack[e])


def test_quantized_linear_reads_strided_rows_and_refuses_a_wrong_width() -> None:
    x = torch.randn(4, 200, generator=_gen(3))[:, :128]  # rows with a stride of 200
    w = torch.randn(70, 128, generator=_gen(4))
    blocks = quant.quantize(w, "q8_0")
    torch.testing.assert_close(ops.linear(x, ops.pack_blocks(blocks, "q8_0")),
                               quant.reference_linear(x.contiguous(), blocks, "q8_0"), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="columns"):
        ops.linear(torch.randn(2, 96), ops.pack_blocks(blocks, "q8_0"))
    with pytest.raises(ValueError):
        ops.pack_blocks(blocks[:, :-1], "q8_0")
    with pytest.raises(quant.QuantizationError):
        quant.quantize(torch.randn(4, 48), "q4_0")


def _moe_oracle(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, fmt: str,
                count: ExpertCount, normalize: bool) -> torch.Tensor:
    weights, ids = route(x @ router.T, count, normalize, torch.float32)
    w_gate_up, w_down = quant.dequantize(gate_up, fmt).double(), quant.dequantize(down, fmt).double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        k = count.k_max if count.per_token is None else int(count.per_token[t])
        for s in range(k):
            e = int(ids[t, s])
            g, u = (quant.activations_as_seen(x[t : t + 1]) @ w_gate_up[e].T).float().chunk(2, dim=-1)
            y = quant.activations_as_seen(F.silu(g) * u) @ w_down[e].T
            out[t] += weights[t, s] * y[0].float()
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("tokens", "count", "normalize"), [(1, ExpertCount(2), True), (6, ExpertCount(2), True),
                                                            (5, ExpertCount(3, torch.tensor([1, 3, 2, 3, 1])), False)])
def test_quantized_moe_equals_the_oracle(fmt: str, tokens: int, count: ExpertCount, normalize: bool,
                                         threads: int) -> None:
    e, h, i = 8, 128, 512  # big enough that the expert products split over two threads
    x = torch.randn(tokens, h, generator=_gen(tokens))
    router = torch.randn(e, h, generator=_gen(2))
    gate_up = quant.quantize(torch.randn(e, 2 * i, h, generator=_gen(3)) * h**-0.5, fmt)
    down = quant.quantize(torch.randn(e, h, i, generator=_gen(4)) * i**-0.5, fmt)
    got = ops.moe(x, router, ops.pack_blocks(gate_up, fmt), ops.pack_blocks(down, fmt), count.k_max,
                  count.per_token, normalize)
    ref = _moe_oracle(x, router, gate_up, down, fmt, count, normalize)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    with pytest.raises(ValueError, match="same format"):
        ops.moe(x, router, ops.pack_blocks(gate_up, fmt), ops.pack(quant.dequantize(down, fmt)), 2, None, True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [7, 9])  # a whole and a partial 4-token tile after the first
def test_quantized_products_are_the_same_on_one_and_two_threads(fmt: str, m: int) -> None:
    x = torch.randn(m, 512, generator=_gen(5))
    w = quant.quantize(torch.randn(4096, 512, generator=_gen(6)), fmt)  # 2M multiply-adds: split over threads
    packed = ops.pack_blocks(w, fmt)
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(ops.linear(x, packed))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["mixtral_moe", "llama_dense_biases"])
def test_one_call_decode_on_quantized_weights(fmt: str, kind: str, threads: int) -> None:
    """The whole-step kernel on Q8_0 / Q4_0 layers: within int8 activation rounding of the torch layer running
    the dequantized weights (which the model holds), and bitwise the same on one and two threads."""
    config, count = KINDS[kind]
    model = _model(config, seed=11)
    quant.quantize_model(model, fmt)
    packed = PackedWeights(model, release=False)
    assert packed.quantized and packed.element.startswith(fmt)
    got = _decode_step(model, count, seed=threads)
    for name in ("h", "out", "k", "v"):
        a, b = got[name], got[f"torch_{name}"]
        assert float((a - b).norm() / b.norm()) < 0.02, name
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3 - threads)
        again = _decode_step(model, count, seed=threads)
    finally:
        torch.set_num_threads(before)
    for name in ("h", "out", "k", "v"):
        assert torch.equal(got[name], again[name]), name


@pytest.mark.slow  # loads the demo model three times per scheme (~6-11 s on a busy machine)
@pytest.mark.parametrize("scheme", FORMATS)
def test_quantized_demo_engine_native_and_fallback(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo model quantized at load: the native backend streams blocks (a quarter to an eighth of the fp32
    bytes), its prompt logits stay close to the plain-torch fallback's (the same quantized model without
    int8 activations), and with the kernels unavailable the engine still runs, on the fallback."""
    model, _ = load_model(DEMO, quantization=scheme)
    assert model.quantized is not None and model.quantized.formats() == sorted({scheme, "q8_0"})
    fp32_bytes = sum(w.numel() * 4 for _, w in quant.target_matrices(model))
    assert model.quantized.nbytes < fp32_bytes * (0.27 if scheme == "q8_0" else 0.2)
    tokens = torch.tensor([5, 300, 17, 942, 8, 77, 1200, 64])
    backend = pick_backend(model)
    assert backend.name == "native" and scheme in backend.weight_format
    fallback = TorchBackend(model)
    from tests.engine.hf_tiny import PagedSequences

    outs = []
    for b in (backend, fallback):
        caches = model.allocate_kv_cache(8, 16, torch.float32)
        ctx, pos = PagedSequences(8, 16).step({0: len(tokens)})
        with torch.inference_mode():
            outs.append(b.forward(tokens, pos, ctx, caches))
    assert float((outs[0] - outs[1]).norm() / outs[1].norm()) < 0.05
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() >= 0.75

    monkeypatch.setattr(ops, "_lib", None)
    monkeypatch.setattr(ops, "_state", "turned off for this test")
    engine = LLMEngine.from_dir(DEMO, quantization=scheme)
    assert engine.runner.backend.name == "torch"
    out = engine.generate([[5, 300, 17]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].output_token_ids) == 8


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(quant.QuantizationError, match="q8_0"):
        load_model(DEMO, quantization="q3_k")


def test_expert_stacks_in_two_formats_run_as_q8_0() -> None:
    """A checkpoint whose expert stacks come in different formats (a GGUF with Q4_0 gate/up and Q8_0 down)
    still runs the fused MoE kernel: both stacks are held as Q8_0 blocks of their values."""
    model = _model(KINDS["mixtral_moe"][0], seed=5)
    weights = quant.quantize_model(model, "q4_0")
    assert weights is not None
    experts: Any = model.model.layers[0].mlp.experts
    weights.add(experts.down_proj, quant.QuantizedMatrix.of(experts.down_proj, "q8_0"))
    packed = PackedWeights(model, release=False)
    gate_up, down = packed.get(experts.gate_up_proj), packed.get(experts.down_proj)
    assert gate_up is not None and down is not None
    assert gate_up.format_name == down.format_name == "q8_0"
    from tests.engine.hf_tiny import PagedSequences

    tokens = torch.tensor([3, 9, 27, 50, 1])
    ctx, pos = PagedSequences(4, 4).step({0: len(tokens)})
    with torch.inference_mode():
        got = pick_backend(model).forward(tokens, pos, ctx, model.allocate_kv_cache(4, 4))
        want = model(tokens, torch.arange(len(tokens)))
    assert float((got - want).norm() / want.norm()) < 0.05
