"""The runner's backends, built from a plain model. Native (`engine.native.prepare`): every projection (and the
stacked experts) is packed, and with ``release`` its row-major storage is given back (held once), routers and
the embedding table keep theirs, and a released model refuses any use but through the backend. Torch
(`TorchBackend`): projections column-major, an untied embedding kept row-major (looked up by row), a tied one
column-major for the LM head. Logits unchanged either way; `pick_backend` takes the native one where it can."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import native
from engine.model import CausalLM, load_model
from engine.native import ops
from engine.native.backend import NativeBackend
from engine.runner import DecodeBackend, TorchBackend, pick_backend
from engine.weights import hf_state_dict
from tests.engine.hf_tiny import PagedSequences, build_hf_model

Forward = Callable[..., torch.Tensor]


def _greedy_logits(forward: Forward, model: CausalLM, prompt: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Last-token logits of a paged prefill and ``steps`` greedy decode steps through ``forward``."""
    seqs = PagedSequences(16, 4, seed=2)
    kv = model.allocate_kv_cache(16, 4)
    out: list[torch.Tensor] = []
    ids = prompt
    with torch.inference_mode():
        for step in range(steps + 1):
            ctx, positions = seqs.step({0: len(prompt) if step == 0 else 1})
            out.append(forward(ids, positions, ctx, kv)[-1])
            ids = out[-1].argmax()[None]
    return out


def _assert_same_logits(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["native", "torch"])
@pytest.mark.parametrize("tied", [False, True])
def test_backend_layout_and_values(tied: bool, kind: str, tmp_path: Path) -> None:
    build_hf_model("qwen2", seed=8, tie_word_embeddings=tied).save_pretrained(tmp_path)
    fast, _ = load_model(tmp_path)
    plain, _ = load_model(tmp_path)
    backend: DecodeBackend
    if kind == "native":
        assert ops.available(), ops.reason()
        backend = native.prepare(fast, release=True)
    else:
        backend = TorchBackend(fast)
    embedding = fast.model.embed_tokens.weight
    assert (fast.lm_head.weight is embedding) == tied
    qkv = fast.model.layers[0].self_attn.qkv_proj.weight
    if isinstance(backend, NativeBackend):
        assert backend.weights.get(qkv) is not None and backend.weights.get(fast.lm_head.weight) is not None
        assert (backend.weights.get(embedding) is not None) == tied
        assert qkv.untyped_storage().nbytes() == 4  # held once: in the packed copy
        assert embedding.untyped_storage().nbytes() == embedding.numel() * 4 and embedding.is_contiguous()
    else:
        assert embedding.stride() == ((1, embedding.shape[0]) if tied else (embedding.shape[1], 1))
        assert qkv.stride(0) == 1
    for (name, a), (_, b) in zip(fast.named_parameters(), plain.named_parameters(), strict=True):
        assert a.shape == b.shape, name
        if a.untyped_storage().nbytes() == a.numel() * 4:  # not released
            assert torch.equal(a, b), name
    prompt = torch.tensor([3, 1, 4, 1, 5])
    _assert_same_logits(_greedy_logits(backend.forward, fast, prompt, 4), _greedy_logits(plain, plain, prompt, 4))


def test_moe_routers_stay_unpacked_and_experts_packed(tmp_path: Path) -> None:
    assert ops.available(), ops.reason()
    build_hf_model("mixtral", seed=3).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    backend = native.prepare(model)
    mlp = model.model.layers[0].mlp
    assert backend.weights.get(mlp.gate.weight) is None
    packed = backend.weights.get(mlp.experts.gate_up_proj)
    assert packed is not None and packed.data.shape[0] == mlp.experts.gate_up_proj.shape[0]
    assert backend.weights.get(mlp.experts.down_proj) is not None


def test_released_weights_refuse_training_and_other_uses(tmp_path: Path) -> None:
    assert ops.available(), ops.reason()
    build_hf_model("mixtral", seed=2).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    native.prepare(model, release=True)
    ids = torch.tensor([3, 1, 4])
    assert not any(p.requires_grad for p in model.parameters())  # nothing left to train
    with pytest.raises(RuntimeError, match="repacked for inference"):
        model(ids, torch.arange(3))  # the plain model holds no values to compute with
    with pytest.raises(RuntimeError, match="repacked for inference"):
        model.model.layers[0](torch.zeros(3, model.config.hidden_size), None, None, None, None, None)
    with pytest.raises(RuntimeError, match="packed inference layout"):
        hf_state_dict(model)
    with pytest.raises(ValueError, match="released to an earlier native backend"):
        native.prepare(model)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="repacked for inference"):
        model.to(torch.float64)(ids, torch.arange(3))
    with pytest.raises(ValueError, match="released to an earlier native backend"):
        native.prepare(model.float())  # converting it back fills the released matrices with zeros: still refused
    trainable, _ = load_model(tmp_path)
    trainable(ids, torch.arange(3)).sum().backward()


def test_without_release_the_model_stays_whole_and_trainable(tmp_path: Path) -> None:
    assert ops.available(), ops.reason()
    build_hf_model("mixtral", seed=2).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    backend = native.prepare(model)
    prompt = torch.tensor([3, 1, 4, 1])
    _assert_same_logits(_greedy_logits(backend.forward, model, prompt, 3), _greedy_logits(model, model, prompt, 3))
    assert all(p.requires_grad for p in model.parameters())
    model(prompt, torch.arange(4)).sum().backward()
    assert model.model.layers[0].self_attn.qkv_proj.weight.grad is not None


@pytest.mark.parametrize("family", ["mixtral", "llama"])
def test_a_bf16_checkpoint_packs_to_bf16_panels_and_decodes_the_same(family: str, tmp_path: Path) -> None:
    """Weights that are exact in bf16 (a bf16 checkpoint) stream as bf16 panels: half the bytes, same logits as
    the fp32 computation, through prefill and the one-call decode path."""
    assert ops.available(), ops.reason()
    hf = build_hf_model(family, seed=6)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    hf.save_pretrained(tmp_path)
    fast, config = load_model(tmp_path)
    plain, _ = load_model(tmp_path)
    backend = native.prepare(fast, release=True)
    assert backend.weights.bf16 and backend.weight_format == "bf16 panels"
    assert all(gap is None for gap in backend.one_call_gaps)
    prompt = torch.randint(0, config.vocab_size, (7,), generator=torch.Generator().manual_seed(1))
    _assert_same_logits(_greedy_logits(backend.forward, fast, prompt, 5), _greedy_logits(plain, plain, prompt, 5))


def test_bf16_exact_weights_pack_to_fp32_panels_when_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TIERGATE_ENGINE_PANELS=fp32`` (the benchmarks' fp32 rows): a bf16 checkpoint keeps fp32 panels."""
    assert ops.available(), ops.reason()
    hf = build_hf_model("mixtral", seed=6)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    hf.save_pretrained(tmp_path)
    monkeypatch.setenv("TIERGATE_ENGINE_PANELS", "fp32")
    forced, _ = load_model(tmp_path)
    backend = native.prepare(forced)
    assert not backend.weights.bf16 and backend.weight_format == "fp32 panels"
    monkeypatch.setenv("TIERGATE_ENGINE_PANELS", "auto")
    assert native.prepare(load_model(tmp_path)[0]).weight_format == "bf16 panels"


def test_weights_not_exact_in_bf16_stay_fp32_panels(tmp_path: Path) -> None:
    assert ops.available(), ops.reason()
    build_hf_model("mixtral", seed=7).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path)
    backend = native.prepare(model)
    packed = backend.weights.get(model.lm_head.weight)
    assert packed is not None and not packed.bf16 and backend.weight_format == "fp32 panels"


def test_pick_backend_takes_native_where_it_can(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ops.available(), ops.reason()
    build_hf_model("mixtral", seed=1).save_pretrained(tmp_path)
    assert isinstance(pick_backend(load_model(tmp_path)[0]), NativeBackend)
    assert isinstance(pick_backend(load_model(tmp_path, dtype=torch.bfloat16)[0]), TorchBackend)
    monkeypatch.setattr(ops, "available", lambda: False)  # what TIERGATE_ENGINE_NATIVE=0 or no compiler gives
    assert isinstance(pick_backend(load_model(tmp_path)[0]), TorchBackend)


def test_an_engine_from_a_model_directory_holds_the_weights_once() -> None:
    """`LLMEngine.from_dir` owns the model it loads, so its backend keeps the only copy (bf16 panels: the
    demo checkpoint is bf16); an engine handed a model leaves it whole."""
    from engine.engine import LLMEngine

    assert ops.available(), ops.reason()
    demo = Path(__file__).resolve().parents[2] / "engine" / "models" / "demo-moe"
    engine = LLMEngine.from_dir(demo, num_blocks=8)
    backend = engine.runner.backend
    assert isinstance(backend, NativeBackend) and backend.weight_format == "bf16 panels"
    assert engine.runner.model.lm_head.weight.untyped_storage().nbytes() == 4  # type: ignore[union-attr]
    model, config = load_model(demo)
    LLMEngine(model, config, num_blocks=8)
    assert model.lm_head.weight.untyped_storage().nbytes() == model.lm_head.weight.numel() * 4


def test_load_model_returns_the_plain_model(tmp_path: Path) -> None:
    """The fast layout is the runner's business: `load_model` gives the plain, trainable model, and its old
    ``decode_layout`` switch is accepted with a deprecation warning and changes nothing."""
    build_hf_model("mixtral", seed=5).save_pretrained(tmp_path)
    with pytest.warns(DeprecationWarning, match="decode_layout"):
        model, _ = load_model(tmp_path, decode_layout=True)
    plain, _ = load_model(tmp_path)
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert a.requires_grad and a.stride() == b.stride() and torch.equal(a, b), name
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_an_engine_on_the_torch_backend_gives_the_native_engines_tokens(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels are not built the runner serves the plain model: same greedy tokens, batched."""
    from engine.engine import LLMEngine
    from engine.sampling_params import SamplingParams

    build_hf_model("mixtral", seed=9).save_pretrained(tmp_path)
    prompts = [[5, 9, 2, 7], [11, 3, 8, 8, 1, 4, 6], [2]]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    model, config = load_model(tmp_path)
    fast = LLMEngine(model, config, eos_token_ids=(), block_size=4, num_blocks=32)
    assert isinstance(fast.runner.backend, NativeBackend)
    monkeypatch.setattr(ops, "available", lambda: False)
    plain = LLMEngine(model, config, eos_token_ids=(), block_size=4, num_blocks=32)
    assert isinstance(plain.runner.backend, TorchBackend)
    assert [o.output_token_ids for o in plain.generate(prompts, greedy)] == \
        [o.output_token_ids for o in fast.generate(prompts, greedy)]
