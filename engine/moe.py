"""Sparse mixture-of-experts: router, expert weights stacked as [E, ...], grouped execution, reference oracle.

Routing is softmax over all experts, then top-k. `normalize_topk` renormalises the kept probabilities to sum
to one (Mixtral always — identical to a softmax over the top-k logits; Qwen2/3-MoE and OLMoE when
`norm_topk_prob`). A per-token expert count takes the top `k_max` and masks the extra slots per token before
renormalising, so each token is renormalised over exactly the k it keeps.

`SparseMoeBlock` receives its router (`gate`) and its experts (mistral-inference style): it routes, then
hands the (token, expert, weight) choices to the experts. `StackedExperts` runs them with `grouped_moe`,
which sorts (token, expert) assignments by expert and runs each selected expert once over all its tokens,
reading that expert's weights once per forward. `reference_moe` is the plain per-expert loop with its own
routing, kept as the test oracle for `grouped_moe` and for the native backend's fused MoE kernel.

Pure torch (the training path and the oracle): must not import the model, attention, engine.native, or
anything outside torch and engine.kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import linear


@dataclass(frozen=True)
class ExpertCount:
    """How many experts each token uses: `k_max` for all, or `per_token` [N] values <= k_max."""

    k_max: int
    per_token: torch.Tensor | None = None


def resolve_experts_per_token(
    value: torch.Tensor | int | None, num_tokens: int, num_experts: int, default: int
) -> ExpertCount:
    """Validate a per-request/per-token expert count; raises ValueError outside 1..num_experts."""
    if value is None:
        return ExpertCount(default)
    if not isinstance(value, torch.Tensor):
        value = int(value)  # plain ints, numpy integers
        if not 1 <= value <= num_experts:
            raise ValueError(f"experts_per_token must be between 1 and {num_experts}, got {value}")
        return ExpertCount(value)
    per_token = value.reshape(-1)
    if per_token.numel() != num_tokens:
        raise ValueError(f"experts_per_token has {per_token.numel()} entries for {num_tokens} tokens")
    if per_token.dtype.is_floating_point:
        raise ValueError("experts_per_token must be an integer tensor")
    if num_tokens == 0:
        return ExpertCount(default)
    lo, hi = int(per_token.min()), int(per_token.max())
    if lo < 1 or hi > num_experts:
        raise ValueError(f"experts_per_token must be between 1 and {num_experts}, got values in [{lo}, {hi}]")
    if lo == hi:
        return ExpertCount(hi)
    return ExpertCount(hi, per_token)


def route(
    router_logits: torch.Tensor, count: ExpertCount, normalize_topk: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] -> (weights [N, k_max] in `dtype`, expert ids [N, k_max]); masked slots weigh 0."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, count.k_max, dim=-1)
    if count.per_token is not None:
        keep = torch.arange(count.k_max, device=weights.device)[None, :] < count.per_token[:, None]
        weights = weights * keep
    if normalize_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def grouped_moe(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    per_token: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [N, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; weights/ids [N, K] -> [N, H].

    Each expert that has tokens runs once over all of them. Slots beyond a token's `per_token` count are
    dropped before grouping, so an expert chosen only in masked slots is never read.
    """
    n_tokens, k = ids.shape
    if n_tokens == 1 and per_token is None:  # batch-1 decode: no sorting, k expert calls
        slot_ids = ids[0].tolist()
        out = _expert(x, gate_up_proj[slot_ids[0]], down_proj[slot_ids[0]]) * weights[0, 0]
        for slot in range(1, k):
            out += _expert(x, gate_up_proj[slot_ids[slot]], down_proj[slot_ids[slot]]) * weights[0, slot]
        return out
    flat_ids = ids.reshape(-1)
    flat_weights = weights.reshape(-1)
    token_of = torch.arange(n_tokens, device=x.device).repeat_interleave(k)
    if per_token is not None:
        keep = (torch.arange(k, device=x.device)[None, :] < per_token[:, None]).reshape(-1)
        flat_ids, flat_weights, token_of = flat_ids[keep], flat_weights[keep], token_of[keep]
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0]).tolist()
    tokens_sorted = token_of[order]
    rows = x.index_select(0, tokens_sorted)  # [A, H]: every (token, expert) assignment, grouped by expert
    outputs = []
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        outputs.append(_expert(rows[start : start + count], gate_up_proj[expert], down_proj[expert]))
        start += count
    if not outputs:  # no tokens
        return torch.zeros_like(x)
    y = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    return torch.zeros_like(x).index_add_(0, tokens_sorted, y * flat_weights[order, None])


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


def reference_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    experts_per_token: torch.Tensor | int,
    normalize_topk: bool,
) -> torch.Tensor:
    """Test oracle: route each token on its own with its own k, then loop over experts (mistral-inference style)."""
    n_tokens = x.shape[0]
    n_experts = router_weight.shape[0]
    ks = (
        [int(experts_per_token)] * n_tokens
        if isinstance(experts_per_token, int)
        else experts_per_token.tolist()
    )
    sel_ids = torch.zeros(n_tokens, n_experts, dtype=torch.bool)
    sel_weights = torch.zeros(n_tokens, n_experts, dtype=x.dtype)
    for t in range(n_tokens):
        k = ks[t]
        if not 1 <= k <= n_experts:
            raise ValueError(f"experts_per_token must be between 1 and {n_experts}, got {k}")
        probs = torch.softmax((x[t] @ router_weight.T).float(), dim=-1)
        top_p, top_i = torch.topk(probs, k)
        if normalize_topk:
            top_p = top_p / top_p.sum()
        sel_ids[t, top_i] = True
        sel_weights[t, top_i] = top_p.to(x.dtype)
    out = torch.zeros_like(x)
    for expert in range(n_experts):
        rows = torch.nonzero(sel_ids[:, expert]).flatten()
        if rows.numel() == 0:
            continue
        gate_up = gate_up_proj[expert]
        inter = gate_up.shape[0] // 2
        h = x[rows]
        y = (F.silu(h @ gate_up[:inter].T) * (h @ gate_up[inter:].T)) @ down_proj[expert].T
        out[rows] += sel_weights[rows, expert, None] * y
    return out


class DenseMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one projection (rows [0:I] gate, [I:2I] up)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, experts_per_token: ExpertCount | None = None) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj.weight, self.down_proj.bias)


class StackedExperts(nn.Module):
    """All experts of one layer: gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.down_proj.shape[-1]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                per_token: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H]; weights / ids [N, K] from `route` -> sum of each token's weighted experts [N, H]."""
        return grouped_moe(x, self.gate_up_proj, self.down_proj, weights, ids, per_token)


class SparseMoeBlock(nn.Module):
    """A router (``gate``: hidden -> one logit per expert) and the experts it routes to, plus an optional
    sigmoid-gated shared expert (Qwen2-MoE). Both are passed in; `build_sparse_moe` makes the usual ones."""

    def __init__(
        self,
        gate: nn.Linear,
        experts: StackedExperts,
        top_k: int,
        normalize_topk: bool,
        shared_expert: DenseMLP | None = None,
        shared_expert_gate: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        if (shared_expert is None) != (shared_expert_gate is None):
            raise ValueError("a shared expert comes with its gate")
        self.gate = gate
        self.experts = experts
        self.num_experts = experts.num_experts
        self.top_k = top_k
        self.normalize_topk = normalize_topk
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    def forward(self, x: torch.Tensor, experts_per_token: ExpertCount | None = None) -> torch.Tensor:
        """x [N, H] -> [N, H]."""
        count = experts_per_token or ExpertCount(self.top_k)
        weights, ids = route(self.gate(x), count, self.normalize_topk, x.dtype)
        out = self.experts(x, weights, ids, count.per_token)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def build_sparse_moe(
    hidden_size: int,
    num_experts: int,
    top_k: int,
    intermediate_size: int,
    normalize_topk: bool,
    shared_expert_intermediate_size: int = 0,
) -> SparseMoeBlock:
    """A `SparseMoeBlock` with a bias-free linear router, stacked experts and, when sized, a shared expert."""
    gate = nn.Linear(hidden_size, num_experts, bias=False)  # built in this order: seeded inits stay as they were
    experts = StackedExperts(num_experts, hidden_size, intermediate_size)
    shared = shared_gate = None
    if shared_expert_intermediate_size:
        shared = DenseMLP(hidden_size, shared_expert_intermediate_size)
        shared_gate = nn.Linear(hidden_size, 1, bias=False)
    return SparseMoeBlock(gate, experts, top_k, normalize_topk, shared, shared_gate)
