"""Grouped MoE execution against the per-expert reference loop, per-token expert counts, and validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.moe import (
    ExpertCount,
    SparseMoeBlock,
    StackedExperts,
    build_sparse_moe,
    grouped_moe,
    reference_moe,
    resolve_experts_per_token,
    route,
)

E, H, INTER = 8, 32, 24


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    down = torch.randn(E, H, INTER, generator=g) * 0.2
    return router, gate_up, down


def _grouped(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
             k: torch.Tensor | int, normalize: bool) -> torch.Tensor:  # fmt: skip
    count = resolve_experts_per_token(k, x.shape[0], E, default=2)
    weights, ids = route(x @ router.T, count, normalize, x.dtype)
    return grouped_moe(x, gate_up, down, weights, ids, count.per_token)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("n_tokens", [1, 5, 37])
def test_grouped_equals_reference_with_varied_k(normalize: bool, n_tokens: int) -> None:
    router, gate_up, down = _weights(0)
    x = torch.randn(n_tokens, H, generator=torch.Generator().manual_seed(n_tokens))
    per_token = torch.randint(1, E + 1, (n_tokens,), generator=torch.Generator().manual_seed(7))
    for k in [per_token, *range(1, E + 1)]:
        expected = reference_moe(x, router, gate_up, down, k, normalize)
        torch.testing.assert_close(
            _grouped(x, router, gate_up, down, k, normalize), expected, rtol=1e-5, atol=1e-5
        )


def test_per_token_k_is_not_the_same_as_max_k() -> None:
    """The masking must bite: tokens asking for k=1 differ from running everyone at k_max."""
    router, gate_up, down = _weights(1)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(3))
    per_token = torch.tensor([1, 4, 1, 2, 4, 3])
    mixed = _grouped(x, router, gate_up, down, per_token, True)
    at_max = _grouped(x, router, gate_up, down, 4, True)
    k1 = _grouped(x, router, gate_up, down, 1, True)
    torch.testing.assert_close(mixed[per_token == 4], at_max[per_token == 4])
    torch.testing.assert_close(mixed[per_token == 1], k1[per_token == 1])
    assert not torch.allclose(mixed[per_token == 1], at_max[per_token == 1])


def test_normalisation_rules() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    w_norm, ids = route(logits, ExpertCount(2), True, torch.float32)
    w_raw, _ = route(logits, ExpertCount(2), False, torch.float32)
    assert ids.tolist() == [[0, 1]]
    # Mixtral rule: softmax over the top-k logits
    torch.testing.assert_close(w_norm, torch.softmax(logits[:, :2], dim=-1))
    torch.testing.assert_close(w_raw, torch.softmax(logits, dim=-1)[:, :2])
    w1, _ = route(logits, ExpertCount(2, torch.tensor([1])), True, torch.float32)
    torch.testing.assert_close(w1, torch.tensor([[1.0, 0.0]]))


def test_each_selected_expert_runs_once_on_all_its_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.moe as moe

    calls: list[int] = []
    real = moe._expert

    def counting(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, gate_up, down)

    monkeypatch.setattr(moe, "_expert", counting)
    router, gate_up, down = _weights(2)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(4))
    count = ExpertCount(2)
    weights, ids = route(x @ router.T, count, True, x.dtype)
    grouped_moe(x, gate_up, down, weights, ids)
    assert len(calls) == len(set(ids.flatten().tolist())) <= E
    assert sum(calls) == 40 * 2


@pytest.mark.parametrize("bad", [0, E + 1, -1])
def test_out_of_range_k_is_a_clear_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match=f"between 1 and {E}"):
        resolve_experts_per_token(bad, 3, E, default=2)
    with pytest.raises(ValueError, match=f"between 1 and {E}"):
        resolve_experts_per_token(torch.tensor([1, bad, 2]), 3, E, default=2)


def test_k_tensor_shape_and_dtype_are_checked() -> None:
    with pytest.raises(ValueError, match="entries for 3 tokens"):
        resolve_experts_per_token(torch.tensor([1, 2]), 3, E, default=2)
    with pytest.raises(ValueError, match="integer"):
        resolve_experts_per_token(torch.tensor([1.0, 2.0, 2.0]), 3, E, default=2)
    assert resolve_experts_per_token(None, 3, E, default=2) == ExpertCount(2)
    assert resolve_experts_per_token(torch.tensor([3, 3, 3]), 3, E, default=2) == ExpertCount(3)


def test_block_with_shared_expert_matches_reference_plus_gate() -> None:
    torch.manual_seed(5)
    block = build_sparse_moe(H, E, 2, INTER, normalize_topk=False, shared_expert_intermediate_size=16)
    with torch.no_grad():
        block.experts.gate_up_proj.normal_(0, 0.2)
        block.experts.down_proj.normal_(0, 0.2)
    x = torch.randn(9, H)
    with torch.no_grad():
        expected = reference_moe(
            x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, 2, False
        ) + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)  # type: ignore[misc]
        torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)


def test_grouped_path_is_differentiable() -> None:
    torch.manual_seed(6)
    block = build_sparse_moe(H, E, 2, INTER, normalize_topk=True)
    with torch.no_grad():
        block.experts.gate_up_proj.normal_(0, 0.2)
        block.experts.down_proj.normal_(0, 0.2)
    block(torch.randn(12, H), ExpertCount(3, torch.randint(1, 4, (12,)))).square().sum().backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
    assert block.experts.gate_up_proj.grad is not None


def test_block_routes_with_the_gate_and_experts_it_is_given() -> None:
    """The block owns neither: a router and experts built elsewhere (shared, pre-loaded) are used as given."""
    router, gate_up, down = _weights(8)
    gate = nn.Linear(H, E, bias=False)
    experts = StackedExperts(E, H, INTER)
    with torch.no_grad():
        gate.weight.copy_(router)
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    block = SparseMoeBlock(gate, experts, top_k=3, normalize_topk=True)
    assert block.gate is gate and block.experts is experts and block.num_experts == E
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(block(x), reference_moe(x, router, gate_up, down, 3, True), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="shared expert comes with its gate"):
        SparseMoeBlock(gate, experts, 2, True, shared_expert_gate=nn.Linear(H, 1, bias=False))
