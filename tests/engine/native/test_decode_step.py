"""The one-call decode step (`engine.native.step`, `tg_decode_step`): token ids in, logits out.

From the same cached context, `NativeBackend.decode` must give bit for bit the logits and the K/V that the
backend's general path gives for the same decode step (the flattened batch through `forward`: the model's
own embedding and RoPE, `tg_decode_layers`, the packed LM head), for MoE and dense layers, bf16 and fp32
panels and Q8_0 blocks, on one thread and two; and the same on one thread as on two (the step's thread team
splits each product's panels and the rows, never a sum). Out-of-range ids and positions are refused, mixed
expert counts follow the forward path's rules, a model off the one-call path has no such step, and the
engine's greedy tokens are the same with the step as without it.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

import pytest
import torch

from engine import native
from engine.config import ModelConfig
from engine.engine import LLMEngine
from engine.model import CausalLM
from engine.native import ops
from engine.native.backend import NativeBackend
from engine.quant import quantize_model
from engine.runner import Span, run_spans
from engine.sampling_params import SamplingParams

BASE = ModelConfig(model_type="mixtral", vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-5,
                   max_position_embeddings=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
                   sparse_layers=(True, True), norm_topk_prob=True)
KINDS: dict[str, tuple[ModelConfig, str]] = {  # sized so that a decode step splits over two threads
    "moe_fp32": (BASE, "fp32"),
    "moe_bf16_panels": (BASE, "bf16"),
    "moe_q8_0": (replace(BASE, num_hidden_layers=1, sparse_layers=(True,)), "q8_0"),
    "dense_biases_window": (replace(BASE, model_type="qwen2", num_experts=0, num_experts_per_tok=0,
                                    sparse_layers=(), qkv_bias=True, intermediate_size=1024, sliding_window=5,
                                    sliding_layers=(True, False)), "fp32"),
}
BLOCK = 4
CONTEXT = (7, 13, 3)  # prompt lengths of the three sequences


@cache
def _backend(kind: str, seed: int = 0) -> tuple[CausalLM, NativeBackend]:
    """A model of ``kind`` and its native backend (weights not released: shared by the tests, read only)."""
    config, weights = KINDS[kind]
    torch.manual_seed(seed)
    model = CausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
            if weights != "fp32":
                p.copy_(p.bfloat16().float())
    if weights == "q8_0":
        quantize_model(model, "q8_0")
    backend = native.prepare(model.eval())
    assert backend.weight_format.startswith({"fp32": "fp32 panels", "bf16": "bf16 panels", "q8_0": "q8_0"}[weights])
    return model, backend


def _prefilled(model: CausalLM, backend: NativeBackend) -> tuple[list[Any], list[list[int]], list[int]]:
    """A cache holding the three prompts (scattered blocks), their block tables and their next tokens."""
    caches = model.allocate_kv_cache(24, BLOCK)
    order = iter([5, 17, 2, 9, 21, 11, 3, 14, 19, 8, 0, 23])
    tables = [[next(order) for _ in range(-(-(n + 1) // BLOCK))] for n in CONTEXT]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in CONTEXT]
    with torch.inference_mode():
        logits = run_spans(backend, caches, BLOCK, [Span(p, 0, t, None, 1) for p, t in zip(prompts, tables,
                                                                                            strict=True)])
    return caches, tables, logits.argmax(-1).tolist()


def _both_paths(kind: str, experts: list[int | None]) -> dict[str, Any]:
    model, backend = _backend(kind)
    caches, tables, tokens = _prefilled(model, backend)
    general = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        expected = run_spans(backend, general, BLOCK, [Span([t], n, table, k, 1) for t, n, table, k in zip(
            tokens, CONTEXT, tables, experts, strict=True)])
    fast = backend.decode(tokens, list(CONTEXT), tables, experts, caches, BLOCK)
    assert fast is not None
    got, argmax = fast
    assert argmax == got.argmax(dim=-1).tolist()  # each row's greedy token, computed with the logits
    return {"got": got, "expected": expected, "caches": caches, "general": general}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_one_call_step_gives_the_general_paths_logits_and_cache(kind: str, threads: int) -> None:
    experts: list[int | None] = [None, None, None] if "moe" in kind else [None] * 3
    run = _both_paths(kind, experts)
    assert run["got"].shape == (3, 300)
    assert torch.equal(run["got"], run["expected"])
    for (k, v), (k2, v2) in zip(run["caches"], run["general"], strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize("kind", ["moe_bf16_panels", "moe_q8_0", "dense_biases_window"])
def test_the_one_call_step_is_the_same_on_one_and_two_threads(kind: str) -> None:
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(_both_paths(kind, [None] * 3)["got"])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])


def test_expert_counts_per_sequence_follow_the_forward_path() -> None:
    run = _both_paths("moe_fp32", [1, 3, 2])
    assert torch.equal(run["got"], run["expected"])
    trained = _both_paths("moe_fp32", [None] * 3)["got"]
    assert not torch.allclose(run["got"], trained)  # the counts were used
    model, backend = _backend("moe_fp32")
    caches, tables, tokens = _prefilled(model, backend)
    with pytest.raises(ValueError, match="explicit experts_per_token"):
        backend.decode(tokens, list(CONTEXT), tables, [1, None, 2], caches, BLOCK)
    with pytest.raises(ValueError, match="between 1 and 8"):
        backend.decode(tokens, list(CONTEXT), tables, [9, 9, 9], caches, BLOCK)


def test_out_of_range_inputs_are_refused_and_nothing_is_written() -> None:
    model, backend = _backend("moe_fp32")
    caches, tables, tokens = _prefilled(model, backend)
    before = [(k.clone(), v.clone()) for k, v in caches]
    for bad in (dict(tokens=[300, 1, 2]), dict(tokens=[-1, 1, 2]), dict(positions=[64, 13, 3]),
                dict(positions=[7, 13, 4 * BLOCK]), dict(tables=[[5, -1], tables[1], tables[2]])):
        args: dict[str, Any] = dict(tokens=tokens, positions=list(CONTEXT), tables=tables) | bad
        if "tables" in bad:
            args["positions"] = [BLOCK + 1, 13, 3]
        with pytest.raises(ValueError, match="out of range"):
            backend.decode(args["tokens"], args["positions"], args["tables"], [None] * 3, caches, BLOCK)
    for (k, v), (k2, v2) in zip(caches, before, strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_a_model_off_the_one_call_path_has_no_one_call_step() -> None:
    model = CausalLM(replace(BASE, qk_norm="head")).eval()
    backend = native.prepare(model)
    caches = model.allocate_kv_cache(8, BLOCK)
    assert backend.decode([1], [0], [[0]], [None], caches, BLOCK) is None


def test_the_engine_decodes_through_the_step_and_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _backend("moe_bf16_panels", seed=4)
    outputs = {}
    for fast in (True, False):
        engine = LLMEngine(model, model.config, eos_token_ids=(), block_size=BLOCK, max_num_seqs=3)
        backend = engine.runner.backend
        assert isinstance(backend, NativeBackend)
        calls = []
        decode = backend.decode

        def counted(*args: Any, decode: Any = decode, calls: list[int] = calls, fast: bool = fast) -> Any:
            calls.append(1)
            return decode(*args) if fast else None

        monkeypatch.setattr(backend, "decode", counted)
        prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        outputs[fast] = [o.output_token_ids for o in outs]
        assert len(calls) >= 7  # every step after the prefills asked the step first
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("n", [1, 7, 16, 37, 300, 4096])
def test_the_native_argmax_is_torchs(n: int) -> None:
    """First maximum on ties, the first NaN where there is one, -inf rows: as torch.argmax, in the vector
    part and the tail of a row."""
    gen = torch.Generator().manual_seed(n)
    rows = torch.randint(-3, 4, (12, n), generator=gen).float()  # many ties
    rows[1] = float("-inf")
    rows[2, n // 2] = float("nan")
    rows[3, -1] = float("nan")
    rows[4, n // 3] = float("inf")
    rows[5, -1] = 100.0
    rows[6] = -0.0
    rows[6, -1] = 0.0
    assert ops.argmax_rows(rows) == rows.argmax(dim=-1).tolist()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_prefill_and_mixed_steps_in_one_call_equal_the_per_op_path(kind: str, threads: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill (13 tokens: rows with contexts 1..13, a sliding window on one layer of the dense kind) and a mixed
    step (a decode beside a 9-token prefill) run every layer in one native call, one row per new token; they
    must give the per-op path's logits and cache (bit for bit where both run the same kernels), and on two
    threads the team (forced here: the
    thread choice would pick by time) shares the attention's (row, KV head) pairs in turn."""
    from engine.native.threads import ThreadChoice

    model, backend = _backend(kind)
    monkeypatch.setattr(ThreadChoice, "pick", lambda self, batch, available: available)
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (13, 9))
    tables = [[5, 17, 2, 9, 21], [11, 3, 14]]

    def run(one_call: bool) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
        caches = model.allocate_kv_cache(24, BLOCK)
        calls = {"decode_layers": 0}
        real = ops.decode_layers

        def counting(*args: Any, **kw: Any) -> torch.Tensor:
            calls["decode_layers"] += 1
            return real(*args, **kw)

        with monkeypatch.context() as m:
            m.setattr(ops, "decode_layers", counting)
            if not one_call:
                m.setattr(backend, "_decode_layers", lambda caches: None)
            with torch.inference_mode():
                first = run_spans(backend, caches, BLOCK, [Span(a, 0, tables[0], None, 13)])
                mixed = run_spans(backend, caches, BLOCK, [Span([int(first[-1].argmax())], 13, tables[0], None, 1),
                                                           Span(b, 0, tables[1], None, 9)])
        assert calls["decode_layers"] == (2 if one_call else 0)
        return first, mixed, caches

    first, mixed, caches = run(True)
    first_ref, mixed_ref, caches_ref = run(False)
    assert first.shape == (13, 300) and mixed.shape == (10, 300)
    if "moe" in kind:  # the same kernels on both paths
        assert torch.equal(first, first_ref) and torch.equal(mixed, mixed_ref)
    else:  # the per-op dense MLP takes torch's SiLU, the one-call one its own (as a decode step always has)
        torch.testing.assert_close(first, first_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed, mixed_ref, rtol=1e-5, atol=1e-5)
    for layer, ((k, v), (k2, v2)) in enumerate(zip(caches, caches_ref, strict=True)):
        if "moe" in kind or layer == 0:  # layer 0's K/V come before any MLP
            assert torch.equal(k, k2) and torch.equal(v, v2)
        else:
            torch.testing.assert_close((k, v), (k2, v2), rtol=1e-5, atol=1e-5)
