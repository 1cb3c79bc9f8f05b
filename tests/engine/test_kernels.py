"""The inference matmul dispatch (`engine.kernels.linear`): same numbers as `F.linear` on every layout, never
on a path that needs gradients, and a whole model routed through it (the plain model on oneDNN, or the
runner's native backend on its packed kernels) still matches HF transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import kernels, native
from engine.model import load_model
from engine.native import ops
from tests.engine.hf_tiny import PagedSequences, build_hf_model

needs_onednn = pytest.mark.skipif(not kernels._ONEDNN, reason="this torch build has no oneDNN linear")


def _layouts(n: int, k: int, seed: int) -> list[torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return [w, w.t().contiguous().t()]  # row-major [N, K] and the model's column-major decode layout


@needs_onednn
@pytest.mark.parametrize("rows", [2, 5, 64])
def test_onednn_linear_equals_f_linear(rows: int) -> None:
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(400)
    for w in _layouts(400, 320, rows):
        for b in (None, bias):
            with torch.inference_mode():
                assert kernels.use_onednn(x, w)
                torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_small_or_single_row_products_stay_on_f_linear() -> None:
    big = torch.randn(400, 320)
    with torch.inference_mode():
        assert not kernels.use_onednn(torch.randn(1, 320), big)  # GEMV: MKL has less per-call overhead
        assert not kernels.use_onednn(torch.randn(8, 16), torch.randn(8, 16))  # a router-sized weight
        assert not kernels.use_onednn(torch.randn(2, 3, 320), big)  # only 2-D inputs
        assert not kernels.use_onednn(torch.randn(4, 320, dtype=torch.float64), big.double())


def test_gradients_always_take_the_autograd_path() -> None:
    w = torch.randn(400, 320, requires_grad=True)
    x = torch.randn(6, 320)
    assert not kernels.use_onednn(x, w)
    kernels.linear(x, w).square().sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    with torch.no_grad():
        assert kernels.use_onednn(x, w) == kernels._ONEDNN


@needs_onednn
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_model_through_onednn_matches_hf(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every projection of a tiny plain model (even GEMVs) on oneDNN: prefill and 12 paged decode steps vs HF."""
    monkeypatch.setattr(kernels, "MIN_ROWS", 1)
    monkeypatch.setattr(kernels, "MIN_WEIGHT_NUMEL", 0)
    hf = build_hf_model(family, seed=4)
    hf.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    prompt = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(5))
    steps = 12
    seqs = PagedSequences(num_blocks=16, block_size=4, seed=6)
    kv = model.allocate_kv_cache(16, 4)
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def counting(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
    ours = _greedy_against_hf(hf, model, prompt, seqs, kv, steps)
    assert calls, "the oneDNN kernel was never called"
    assert ours == hf_out_tokens(hf, prompt, steps)


# what decodes each family: the whole step in one native call, per-op native calls (a shared expert is not in the
# one-call path), or torch attention around native products (q/k norms are not in either)
DECODE_PATH = {"mixtral": "decode_layers", "llama": "decode_layers", "qwen2_moe": "paged_decode", "olmoe": "linear"}


@pytest.mark.parametrize("family", sorted(DECODE_PATH))
def test_model_through_native_kernels_matches_hf(family: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The default serving path: packed projections, fused MoE and paged decode attention in the native backend
    (`engine.native`), prefill and 12 paged decode steps vs HF, each family on the native path it should take
    (the prefill too: a one-call family prefills in decode_layers, one row per token)."""
    assert ops.available(), ops.reason()
    hf = build_hf_model(family, seed=4)
    hf.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    backend = native.prepare(model, release=True)
    calls: dict[str, int] = {"linear": 0, "moe": 0, "paged_decode": 0, "decode_layers": 0}
    for name in calls:
        real = getattr(ops, name)

        def counting(*args: object, _name: str = name, _real: object = real, **kw: object) -> torch.Tensor:
            calls[_name] += 1
            return _real(*args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(ops, name, counting)
    prompt = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(5))
    seqs = PagedSequences(num_blocks=16, block_size=4, seed=6)
    ours = _greedy_against_hf(hf, backend.forward, prompt, seqs, model.allocate_kv_cache(16, 4), 12)
    assert calls["linear"] and calls[DECODE_PATH[family]], calls
    assert bool(calls["decode_layers"]) == (DECODE_PATH[family] == "decode_layers"), calls
    # the fused MoE op runs where layers go op by op (a family off the one-call path, prefill included); on the
    # one-call path every step, the prefill too, runs its experts inside decode_layers
    assert bool(calls["moe"]) == (config.is_moe and DECODE_PATH[family] != "decode_layers"), calls
    assert ours == hf_out_tokens(hf, prompt, 12)


def hf_out_tokens(hf: torch.nn.Module, prompt: torch.Tensor, steps: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(prompt[None], max_new_tokens=steps, do_sample=False)  # type: ignore[operator]
    return out[0, len(prompt):].tolist()  # type: ignore[no-any-return]


def _greedy_against_hf(hf: torch.nn.Module, model: Callable[..., torch.Tensor], prompt: torch.Tensor,
                       seqs: PagedSequences, kv: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> list[int]:
    """Our prefill + paged greedy decode, each step's logits checked against HF's (fp32, 1e-4 relative)."""
    with torch.inference_mode():
        hf_out = hf.generate(prompt[None], max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        ctx, positions = seqs.step({0: len(prompt)})
        logits = model(prompt, positions, ctx, kv)
        ours: list[int] = []
        for step in range(steps):
            torch.testing.assert_close(logits[-1], hf_out.logits[step][0], rtol=1e-4, atol=1e-5)
            ours.append(int(logits[-1].argmax()))
            ctx, positions = seqs.step({0: 1})
            logits = model(torch.tensor([ours[-1]]), positions, ctx, kv)
    return ours
