"""The training loop for the demo models: packed token windows, random experts-per-token, AdamW.

The model is passed in: anything with the engine's full-sequence forward signature
`model(input_ids[T], positions[T], None, None, experts_per_token=k) -> logits[T, vocab]`
(`engine.model.CausalLM` with `ctx=None`). Each step draws k from `TrainConfig.k_choices`
with a seeded generator, so a MoE model learns to work with fewer experts than it was
built for; a dense model ignores k. A router load-balancing loss is added when the model
has MoE routers (see `engine.train.balance`).

Checkpointing is a callback, so a stopped run still leaves a usable model on disk.
Must not import the gateway, the classifier or any web/db library.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.train.balance import RouterBalance


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 512
    batch_size: int = 4                 # windows per optimiser step (one batched forward)
    steps: int = 3000
    max_minutes: float | None = None    # stop (and checkpoint) when the wall clock runs out; LR decays by time too
    lr: float = 2e-3
    min_lr_fraction: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    k_choices: tuple[int, ...] = (1, 2)
    k_weights: tuple[float, ...] = (0.5, 0.5)
    balance_coef: float = 0.01
    seed: int = 1234
    log_every: int = 50
    checkpoint_every: int = 500
    # One intra-op thread by default: while other jobs share the CPU, two threads ran far slower than
    # one in our runs (each op waits for the descheduled thread). `tiergate engine train --threads N`.
    threads: int | None = 1


@dataclass
class TrainReport:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)   # (step, mean train loss since last log)
    stopped_by: str = "steps"

    @property
    def final_loss(self) -> float:
        return self.losses[-1][1] if self.losses else float("nan")


ForwardModel = Callable[..., torch.Tensor]


def lr_at(step: int, cfg: TrainConfig, time_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to `min_lr_fraction * lr` at `cfg.steps`.

    `time_fraction` (elapsed / max_minutes) advances the decay when the wall clock runs out
    before the steps do, so a run capped by time still ends annealed.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    progress = max(progress, min(1.0, time_fraction))
    floor = cfg.lr * cfg.min_lr_fraction
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def sample_windows(ids: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 1] random windows of the token stream (input plus shifted target)."""
    if ids.numel() < seq_len + 2:
        raise ValueError(f"token stream of {ids.numel()} tokens is shorter than one window ({seq_len + 1})")
    starts = torch.randint(0, ids.numel() - seq_len - 1, (batch,), generator=gen)
    return torch.stack([ids[s: s + seq_len + 1].long() for s in starts.tolist()])


def window_loss(model: ForwardModel, windows: torch.Tensor, k: int | None) -> torch.Tensor:
    """Mean next-token cross-entropy over windows [..., T+1] (`[..., :-1]` predicts `[..., 1:]`)."""
    inputs, targets = windows[..., :-1], windows[..., 1:]
    positions = torch.arange(inputs.shape[-1], dtype=torch.long)
    logits = model(inputs, positions, None, None, experts_per_token=k)   # [..., T, vocab]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Decay matrices; never decay norms, biases or 1-D parameters."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(
    model: nn.Module,
    train_ids: torch.Tensor,
    cfg: TrainConfig,
    num_experts: int | None = None,
    checkpoint: Callable[[int], None] | None = None,
    log: Callable[[str], None] = print,
) -> TrainReport:
    """Train `model` in place on random windows of `train_ids`; returns what happened."""
    if len(cfg.k_choices) != len(cfg.k_weights):
        raise ValueError("k_choices and k_weights differ in length")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    k_rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))  # type: ignore[arg-type]
    balance = RouterBalance(model, num_experts) if num_experts else None
    report = TrainReport()
    deadline = time.monotonic() + cfg.max_minutes * 60 if cfg.max_minutes else None
    start = time.monotonic()
    running, running_n = 0.0, 0
    model.train()
    try:
        for step in range(cfg.steps):
            k = k_rng.choices(cfg.k_choices, weights=cfg.k_weights)[0] if num_experts else None
            time_fraction = (time.monotonic() - start) / (cfg.max_minutes * 60) if cfg.max_minutes else 0.0
            lr = lr_at(step, cfg, time_fraction)
            for group in opt.param_groups:
                group["lr"] = lr
            if balance is not None:
                balance.reset(k or 1)
            loss = window_loss(model, sample_windows(train_ids, cfg.seq_len, cfg.batch_size, gen), k)
            total = loss + cfg.balance_coef * balance.loss() if balance is not None else loss
            total.backward()
            running += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            running_n += 1
            report.steps = step + 1
            report.tokens += cfg.batch_size * cfg.seq_len
            if report.steps % cfg.log_every == 0 or report.steps == cfg.steps:
                report.losses.append((report.steps, running / running_n))
                log(f"step {report.steps}/{cfg.steps} k={k} loss {running / running_n:.4f} "
                    f"lr {lr:.2e} {time.monotonic() - start:.0f}s")
                running, running_n = 0.0, 0
            if checkpoint is not None and report.steps % cfg.checkpoint_every == 0:
                checkpoint(report.steps)
            if deadline is not None and time.monotonic() > deadline:
                report.stopped_by = "minutes"
                break
    finally:
        if balance is not None:
            balance.close()
        model.eval()
    if running_n:
        report.losses.append((report.steps, running / running_n))
    report.seconds = time.monotonic() - start
    if checkpoint is not None:
        checkpoint(report.steps)
    return report


@torch.inference_mode()
def perplexity(
    model: ForwardModel, ids: torch.Tensor, seq_len: int, k: int | None = None, max_windows: int | None = None,
) -> float:
    """exp(mean next-token loss) over consecutive non-overlapping windows of `ids`."""
    total, count = 0.0, 0
    starts: Sequence[int] = range(0, max(0, ids.numel() - 1), seq_len)
    if max_windows is not None:
        starts = list(starts)[:max_windows]
    for s in starts:
        window = ids[s: s + seq_len + 1].long()
        if window.numel() < 2:
            continue
        n = window.numel() - 1
        total += window_loss(model, window, k).item() * n
        count += n
    if count == 0:
        raise ValueError("no tokens to evaluate")
    return math.exp(total / count)
