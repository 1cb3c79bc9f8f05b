"""Paged attention against full recomputation: mixed prefill/decode batches, chunked prefill over a cached
prefix, batched decode of different lengths, per-token expert counts, sliding windows, logits selection."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.attention import AttentionContext
from engine.model import CausalLM, load_model
from tests.engine.hf_tiny import PagedSequences, build_hf_model


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_moe")
    build_hf_model("qwen3_moe", seed=11).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> CausalLM:
    return load_model(qwen3_dir)[0]


SCHEDULE = [  # sequence id -> new tokens this step
    {0: 5, 1: 6},  # two prefills
    {0: 4, 1: 1},  # chunked prefill on a cached prefix + a decode
    {0: 1, 1: 1, 2: 7},  # decodes + a fresh prefill
    {0: 1, 1: 1, 2: 1},  # batched decode, three different lengths
    {2: 1, 0: 1},
    {1: 3, 2: 1},  # a prefill chunk after decodes
    {0: 1, 1: 1, 2: 1},
]


def _expert_count(position: int) -> int:
    return 1 + position % 8


@pytest.mark.parametrize("block_size", [3, 16])
@pytest.mark.parametrize("per_token_k", [False, True])
def test_mixed_batches_equal_recomputation(qwen3: CausalLM, block_size: int, per_token_k: bool) -> None:
    kv = qwen3.allocate_kv_cache(64, block_size)

    def step_logits(flat: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        k = torch.tensor([_expert_count(int(p)) for p in positions]) if per_token_k else None
        return qwen3(flat, positions, ctx, kv, experts_per_token=k)

    def recomputed(full: torch.Tensor) -> torch.Tensor:
        k_full = torch.tensor([_expert_count(p) for p in range(len(full))]) if per_token_k else None
        return qwen3(full, torch.arange(len(full)), experts_per_token=k_full)

    _replay_schedule(step_logits, recomputed, qwen3.config.vocab_size, block_size, seed=block_size)


def _replay_schedule(step_logits: Callable[[torch.Tensor, torch.Tensor, AttentionContext], torch.Tensor],
                     recomputed: Callable[[torch.Tensor], torch.Tensor], vocab: int, block_size: int,
                     seed: int) -> None:
    """Run SCHEDULE's steps (random tokens) through ``step_logits`` over a paged cache; each sequence's new
    rows must equal ``recomputed`` on its whole history."""
    gen = torch.Generator().manual_seed(seed)
    seqs = PagedSequences(num_blocks=64, block_size=block_size, seed=block_size)
    history: dict[int, list[int]] = {}
    with torch.inference_mode():
        for step in SCHEDULE:
            new = {s: torch.randint(0, vocab, (n,), generator=gen).tolist() for s, n in step.items()}
            ctx, positions = seqs.step(step)
            logits = step_logits(torch.tensor([t for s in step for t in new[s]]), positions, ctx)
            start = 0
            for s, n in step.items():
                history.setdefault(s, []).extend(new[s])
                _close(logits[start:start + n], recomputed(torch.tensor(history[s]))[-n:])
                start += n


def test_last_token_indices_select_rows(qwen3: CausalLM) -> None:
    seqs = PagedSequences(num_blocks=16, block_size=4)
    kv = qwen3.allocate_kv_cache(16, 4)
    ctx, positions = seqs.step({0: 5, 1: 3})
    ids = torch.arange(8) + 10
    with torch.inference_mode():
        full = qwen3(ids, positions, ctx, kv)
        seqs2 = PagedSequences(num_blocks=16, block_size=4)
        kv2 = qwen3.allocate_kv_cache(16, 4)
        ctx2, _ = seqs2.step({0: 5, 1: 3})
        last = qwen3(ids, positions, ctx2, kv2, last_token_indices=ctx2.query_start_loc[1:] - 1)
    assert last.shape == (2, qwen3.config.vocab_size)
    _close(last, full[[4, 7]])


@pytest.mark.parametrize(
    ("family", "overrides", "sliding_layers"),
    [
        ("mixtral", {"sliding_window": 5}, (True, True)),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}, (False, True)),
    ],
    ids=["mixtral", "qwen2"],
)
def test_sliding_window_matches_hf_and_recomputation(
    family: str, overrides: dict[str, object], sliding_layers: tuple[bool, ...], tmp_path: Path
) -> None:
    hf = build_hf_model(family, seed=12, **overrides)
    hf.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.sliding_window == 5
    assert config.sliding_layers == sliding_layers
    prompt = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    seqs = PagedSequences(num_blocks=16, block_size=4)
    kv = model.allocate_kv_cache(16, 4)
    with torch.inference_mode():
        expected = hf(prompt[None]).logits[0]
        _close(model(prompt, torch.arange(12)), expected)
        ctx, positions = seqs.step({0: 12})
        _close(model(prompt, positions, ctx, kv), expected)
        # the window must matter: without it the logits differ
        unwindowed = build_hf_model(family, seed=12)(prompt[None]).logits[0]
        assert not torch.allclose(unwindowed[-1], expected[-1], atol=1e-3)
        tokens = prompt.tolist()
        for t in [3, 7, 9]:
            tokens.append(t)
            ctx, positions = seqs.step({0: 1})
            step_logits = model(torch.tensor([t]), positions, ctx, kv)[0]
            _close(step_logits, hf(torch.tensor([tokens])).logits[0, -1])


def test_paged_forward_rejects_bad_inputs(qwen3: CausalLM) -> None:
    seqs = PagedSequences(num_blocks=4, block_size=4)
    ctx, positions = seqs.step({0: 3})
    kv = qwen3.allocate_kv_cache(4, 4)
    with pytest.raises(ValueError, match="one KV cache pair per layer"):
        qwen3(torch.tensor([1, 2, 3]), positions, ctx, kv[:1])
    with pytest.raises(ValueError, match="between 1 and 8"):
        qwen3(torch.tensor([1, 2, 3]), positions, ctx, kv, experts_per_token=9)


def test_bfloat16_cache_and_weights_run(tmp_path: Path) -> None:
    """Lower precision is a supported load option: close to fp32, not bit-equal."""
    build_hf_model("olmoe", seed=13).save_pretrained(tmp_path)
    model32, _ = load_model(tmp_path)
    model16, _ = load_model(tmp_path, dtype=torch.bfloat16)
    seqs = PagedSequences(num_blocks=8, block_size=4)
    kv = model16.allocate_kv_cache(8, 4)
    ids = torch.arange(6) + 3
    ctx, positions = seqs.step({0: 6})
    with torch.inference_mode():
        low = model16(ids, positions, ctx, kv).float()
        high = model32(ids, positions)
    assert kv[0][0].dtype == torch.bfloat16
    assert (low - high).norm() / high.norm() < 0.05


def test_batched_no_cache_path_equals_per_sequence_and_is_differentiable(qwen3: CausalLM, qwen3_dir: Path) -> None:
    """The training path: input_ids [B, T] with shared positions [T], experts_per_token an int (inference mode,
    then gradients on a fresh copy of the same plain model)."""
    ids = torch.randint(0, qwen3.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(8))
    positions = torch.arange(9)
    with torch.inference_mode():
        batched = qwen3(ids, positions, experts_per_token=1)
        for row in range(3):
            _close(batched[row], qwen3(ids[row], positions, experts_per_token=1))
    qwen3, _ = load_model(qwen3_dir)
    logits = qwen3(ids, positions, None, None, experts_per_token=3)
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)).backward()
    grads = [p.grad for p in qwen3.parameters()]
    qwen3.zero_grad(set_to_none=True)
    assert all(g is not None for g in grads)  # every parameter (router, experts, q/k norms) gets a gradient


@pytest.mark.parametrize(("family", "overrides", "block_size"),
                         [("qwen3_moe", {}, 3), ("qwen3_moe", {}, 16), ("mixtral", {"sliding_window": 5}, 4)],
                         ids=["qwen3-block3", "qwen3-block16", "mixtral-window5"])
def test_native_prefill_and_mixed_steps_equal_recomputation(family: str, overrides: dict[str, object],
                                                            block_size: int, tmp_path: Path) -> None:
    """The native backend runs a prefill or mixed step's attention on its paged decode kernel, one query per new
    token (`PagedPlan.per_token`): fresh prefills, a chunk over a cached prefix, decodes beside a prefill, a
    sliding window — each step's logits equal the model recomputed on the whole history."""
    from engine.native import backend as native
    from engine.native import ops

    if not ops.available():
        pytest.skip(f"native kernels not built: {ops.reason()}")
    build_hf_model(family, seed=13, **overrides).save_pretrained(tmp_path)
    model = load_model(tmp_path)[0]
    fast = native.prepare(model)
    kv = model.allocate_kv_cache(64, block_size)
    _replay_schedule(lambda flat, positions, ctx: fast.forward(flat, positions, ctx, kv),
                     lambda full: model(full, torch.arange(len(full))), model.config.vocab_size, block_size, seed=5)
