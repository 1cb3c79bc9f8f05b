"""Router load-balancing loss for MoE training, collected with forward hooks.

The model's forward returns logits only, so the router logits of every MoE layer are
captured by hooks on the router modules (a module named `...gate` whose weight has one
row per expert, the Hugging Face naming for Mixtral / Qwen2-MoE routers). The loss is
the Switch-Transformer / Mixtral auxiliary loss `E * sum_e f_e * P_e`, where `f_e` is
the fraction of token-slots whose top-k choice is expert e and `P_e` the mean router
probability of e, averaged over layers. It is 1.0 when routing is perfectly balanced.

Must not import the gateway, the classifier or any web/db library.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def router_modules(model: nn.Module, num_experts: int) -> list[tuple[str, nn.Module]]:
    found = []
    for name, mod in model.named_modules():
        weight = getattr(mod, "weight", None)
        if (name.endswith(".gate") and isinstance(weight, torch.Tensor) and weight.ndim == 2
                and weight.shape[0] == num_experts):
            found.append((name, mod))
    return found


class RouterBalance:
    """Collects router logits during one forward pass and turns them into a balance loss."""

    def __init__(self, model: nn.Module, num_experts: int) -> None:
        self.num_experts = num_experts
        self.k = 1
        self._logits: list[torch.Tensor] = []
        routers = router_modules(model, num_experts)
        if not routers:
            raise ValueError(f"no router modules with {num_experts} experts found in the model")
        self._handles = [mod.register_forward_hook(self._hook) for _, mod in routers]

    def _hook(self, _mod: nn.Module, _inputs: Any, output: Any) -> None:
        outs = output if isinstance(output, tuple) else (output,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.shape[-1] == self.num_experts and t.is_floating_point():
                self._logits.append(t.reshape(-1, self.num_experts))
                return

    def reset(self, k: int) -> None:
        self.k = k
        self._logits.clear()

    def loss(self) -> torch.Tensor:
        if not self._logits:
            raise RuntimeError("no router logits were captured in this forward pass")
        total = torch.zeros(())
        for logits in self._logits:
            probs = logits.float().softmax(dim=-1)                      # [T, E]
            chosen = probs.topk(self.k, dim=-1).indices                  # [T, k]
            counts = torch.zeros(self.num_experts).index_add_(
                0, chosen.reshape(-1), torch.ones(chosen.numel()))
            fraction = counts / chosen.numel()                           # f_e
            total = total + self.num_experts * (fraction * probs.mean(dim=0)).sum()
        n = len(self._logits)
        self._logits.clear()
        return total / n

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
