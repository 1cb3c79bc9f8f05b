"""How far ahead a one-token product prefetches its weights: measured on this machine, once per process.

A batch-1 decode step streams every active weight from DRAM once, so its speed is one core's streaming rate.
The AVX2 kernels' one-token loop can prefetch each panel row a fixed distance ahead (``tg_set_row_prefetch``);
whether that helps depends on the machine, not on its instruction set: on one AVX2 EPYC it took a batch-1
product from 8-13 to 16-17 GB/s, on another it cost 13% (19.4 GB/s without, 17.1 with; there the hardware
prefetchers keep more lines in flight than the few L1 fill buffers a software prefetch holds). So `calibrate`
times a one-token product over the model's own packed weights with the prefetch on and off, alternating, and
keeps the faster where it is faster by more than `MARGIN` (the compiled distance otherwise). fp32 and bf16
panels are chosen apart (bf16 reads half the bytes and converts each weight: on the machine above it made
no difference there). Results do not depend on the choice, only speed.

Only weights that do not fit in the last-level cache are worth the measurement: a model whose packed panels
of a format are under twice its size streams them from cache, and that format's distance stays as it is
until a larger model comes. ``TIERGATE_NATIVE_ROW_PREFETCH`` (bytes; 0 = off) sets the distance for both
formats instead of measuring.

Imports torch and engine.native.ops only.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.native import ops

ENV = "TIERGATE_NATIVE_ROW_PREFETCH"
COMPILED = 8192  # tg_kernels.c's TG_PF: the distance the library starts with
CANDIDATES = (COMPILED, 0)  # the compiled distance first: it stays unless another is clearly faster
MARGIN = 1.03  # another distance must be this much faster (medians) to replace the compiled one
ROUNDS = 5
DEFAULT_LLC = 32 << 20


@dataclass(frozen=True)
class Choice:
    """The distance chosen for one panel format (bytes; 0 = no prefetch) and why: ``"measured"`` (with each
    candidate's median bytes/s), ``"environment"``, or ``"cached weights"`` (nothing to measure)."""

    fmt: int
    distance: int
    reason: str
    rates: dict[int, float] = field(default_factory=dict)

    def describe(self) -> str:
        what = "off" if self.distance == 0 else f"{self.distance // 1024} KiB ahead"
        head = f"{ops.FORMAT_NAMES[self.fmt]} one-token weight prefetch {what}"
        if self.reason != "measured":
            return f"{head} ({self.reason})"
        rates = ", ".join(f"{'off' if d == 0 else f'{d // 1024} KiB'} {r / 1e9:.1f} GB/s" for d, r in self.rates.items())
        return f"{head} (measured: {rates})"


_chosen: dict[int, Choice] = {}  # by panel format, once per process


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (``DEFAULT_LLC`` where it cannot be read)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=DEFAULT_LLC)


def pick(seconds: dict[int, list[float]]) -> int:
    """The distance to keep from each candidate's pass times: the fastest median if it beats the first
    candidate's (the compiled distance) by ``MARGIN``, else the first."""
    first = next(iter(seconds))
    medians = {d: statistics.median(ts) for d, ts in seconds.items()}
    best = min(medians, key=lambda d: medians[d])
    return best if medians[first] > MARGIN * medians[best] else first


def _matrices(packed: Iterable[ops.Packed], fmt: int) -> Iterator[ops.Packed]:
    """Each matrix of ``fmt`` panels, a stack's experts one by one."""
    for p in packed:
        if p.fmt != fmt:
            continue
        if p.data.dim() == 2:  # a stack [E, words]
            for i in range(p.data.shape[0]):
                yield ops.Packed(p.data[i], p.n, p.k, fmt=p.fmt)
        else:
            yield p


def calibrate(packed: Iterable[ops.Packed], budget_bytes: int | None = None) -> list[Choice]:
    """Choose the one-token prefetch distance of each panel format among ``packed`` for this process (see the
    module docstring) and set it; a format's first choice stands, later calls return it. ``budget_bytes``:
    how much of the weights a pass reads (default four times the last-level cache). Quantized blocks are not
    read by the loop this tunes and are left out."""
    matrices = list(packed)
    return [_calibrate(matrices, fmt, budget_bytes) for fmt in (ops.F32, ops.BF16)
            if any(p.fmt == fmt for p in matrices)]


def _calibrate(packed: list[ops.Packed], fmt: int, budget_bytes: int | None) -> Choice:
    if fmt in _chosen:
        return _chosen[fmt]
    configured = os.environ.get(ENV, "").strip()
    if configured:
        ops.set_row_prefetch(fmt, int(configured))
        _chosen[fmt] = Choice(fmt, ops.row_prefetch(fmt), "environment")
        return _chosen[fmt]
    llc = last_level_cache_bytes()
    budget = budget_bytes if budget_bytes is not None else 4 * llc
    chosen: list[ops.Packed] = []
    total = 0
    for p in _matrices(packed, fmt):
        if total >= budget:
            break
        chosen.append(p)
        total += p.data.numel() * p.data.element_size()
    if total < 2 * llc:
        return Choice(fmt, ops.row_prefetch(fmt), "cached weights")  # not kept: a larger model may come later
    inputs = {p.k: torch.full((1, p.k), 0.01) for p in chosen}
    seconds: dict[int, list[float]] = {d: [] for d in CANDIDATES}
    before = ops.row_prefetch(fmt)
    try:
        for _ in range(ROUNDS):
            for distance in CANDIDATES:
                ops.set_row_prefetch(fmt, distance)
                start = time.perf_counter()
                for p in chosen:
                    ops.linear(inputs[p.k], p, threads=1)
                seconds[distance].append(time.perf_counter() - start)
    finally:
        ops.set_row_prefetch(fmt, before)
    distance = pick(seconds)
    ops.set_row_prefetch(fmt, distance)
    _chosen[fmt] = Choice(fmt, distance, "measured", {d: total / statistics.median(ts) for d, ts in seconds.items()})
    return _chosen[fmt]


def current(fmt: int) -> Choice | None:
    """This process's choice for ``fmt`` panels so far (None before a model large enough to measure on)."""
    return _chosen.get(fmt)
