"""How the kernels prefetch weights: measured on this machine, once per process.

A decode step streams every weight it uses from DRAM once, so its speed is one core's streaming rate, and how
the kernels' software prefetches help that depends on the machine, not only on its instruction set. Two
process-wide knobs, neither of which changes a bit of any result:

- **The level** (`set_level`): into which cache every kernel's prefetches bring weight lines, L1 (0) or L2 (1).
  On Sapphire Rapids L2 was faster (4 / 16-token fp32 products from DRAM on two cores, 22.8 / 14.4 GB/s with L1
  and 23.8 / 17.6 with L2); on an AMD EPYC Zen 5 the other way (one core, 4 tokens: fp32 1.14x, q8_0 1.09x
  faster with L1). `calibrate_level` times a 4-token product (what a MoE expert sees under concurrent decoding,
  and a short verify step) over the model's own weights, every format, at both levels, alternating.
- **The one-token distance** (`set_row_prefetch`): how far ahead a one-token product (the AVX2 one-token loop,
  the AVX-512 one-token tile) prefetches each panel row (0: not at all). On one AVX2 EPYC it took a batch-1
  product from 8-13 to 16-17 GB/s, on another it cost 13% (19.4 GB/s without, 17.1 with; there the hardware
  prefetchers keep more lines in flight than the few L1 fill buffers a software prefetch holds); on an AMD EPYC
  Zen 5 (AVX-512) it cost 4-6% for fp32 panels and 3% for bf16 (one core, 40 fp32 2560x768 matrices from DRAM,
  builds alternated: 35.2 GB/s with it, 36.7 without). `calibrate` times a one-token product with it on and off,
  fp32 and bf16 panels apart (bf16 reads half the bytes and converts each weight).

Each keeps the library's setting unless the other is faster by more than `MARGIN` (medians of `ROUNDS` alternating
passes over up to four times the last-level cache, a few ms each: ~0.1 s a knob at load). With 5 rounds and a 3%
margin the level on a Zen 5 flipped between runs (L1 measured 1-7% faster in ten runs, kept in half of them, and
the bench MoE's 16-stream decode moved with it); 11 rounds and 1.5% chose L1 in each of the three runs since.
Only weights that do not fit in the last-level cache are worth the measurement: a model whose packed weights are
under twice its size streams them from cache, and the setting stays as it is until a larger model comes.
``TIERGATE_NATIVE_PREFETCH_LEVEL`` (``l1`` / ``l2``) and ``TIERGATE_NATIVE_ROW_PREFETCH`` (bytes; 0 = off, both
panel formats) set them instead of measuring.

Imports torch and engine.native.ops only.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.native import ops

ENV = "TIERGATE_NATIVE_ROW_PREFETCH"
LEVEL_ENV = "TIERGATE_NATIVE_PREFETCH_LEVEL"
LEVELS = {"l1": 0, "l2": 1}
DISTANCE = 8192  # tg_kernels.c's TG_PF: the distance tried against none (AVX2 builds start with it, AVX-512 without)
CANDIDATES = (DISTANCE, 0)  # timed with the library's current one first: it stays unless the other is clearly faster
LEVEL_TOKENS = 4  # tokens of the product the level is timed on
MARGIN = 1.015  # another setting must be this much faster (medians) to replace the current one
ROUNDS = 11
DEFAULT_LLC = 32 << 20


# -- the knobs ----------------------------------------------------------------------------------------
def set_row_prefetch(fmt: int, nbytes: int) -> int:
    """Set how far ahead (bytes, rounded down to a cache line; 0: not at all) a one-token product over ``fmt``
    panels (`ops.F32` or `ops.BF16`) prefetches its weights; returns the previous distance."""
    if fmt not in (ops.F32, ops.BF16):
        raise ValueError("the prefetch distance is set for fp32 or bf16 panels")
    return int(ops.library().tg_set_row_prefetch(fmt, nbytes))


def row_prefetch(fmt: int) -> int:
    """The one-token products' prefetch distance in bytes over ``fmt`` panels (see `set_row_prefetch`)."""
    if fmt not in (ops.F32, ops.BF16):
        raise ValueError("the prefetch distance is set for fp32 or bf16 panels")
    return int(ops.library().tg_row_prefetch(fmt))


def set_level(level: int) -> int:
    """Into which cache every kernel's weight prefetches bring their lines: 0 = L1, 1 = L2; returns the previous
    level."""
    if level not in (0, 1):
        raise ValueError("the prefetch level is 0 (L1) or 1 (L2)")
    return int(ops.library().tg_set_prefetch_level(level))


def level() -> int:
    return int(ops.library().tg_prefetch_level())


# -- the choices --------------------------------------------------------------------------------------
def _rates(rates: dict[int, float], name: Callable[[int], str]) -> str:
    return ", ".join(f"{name(c)} {r / 1e9:.1f} GB/s" for c, r in rates.items())


def _distance_name(d: int) -> str:
    return "off" if d == 0 else f"{d // 1024} KiB"


def _level_name(level: int) -> str:
    return f"L{level + 1}"


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
        return f"{head} (measured: {_rates(self.rates, _distance_name)})"


@dataclass(frozen=True)
class LevelChoice:
    """The prefetch level chosen for every kernel (0 = L1, 1 = L2) and why, as `Choice`."""

    level: int
    reason: str
    rates: dict[int, float] = field(default_factory=dict)

    def describe(self) -> str:
        head = f"weight prefetch into {_level_name(self.level)}"
        if self.reason != "measured":
            return f"{head} ({self.reason})"
        return f"{head} (measured on {LEVEL_TOKENS}-token products: {_rates(self.rates, _level_name)})"


_chosen: dict[int, Choice] = {}  # by panel format, once per process
_level: LevelChoice | None = None  # the process's level, once decided


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
    """The setting to keep from each candidate's pass times: the fastest median if it beats the first
    candidate's (the setting in use) by ``MARGIN``, else the first."""
    first = next(iter(seconds))
    medians = {d: statistics.median(ts) for d, ts in seconds.items()}
    best = min(medians, key=lambda d: medians[d])
    return best if medians[first] > MARGIN * medians[best] else first


def _matrices(packed: Iterable[ops.Packed], fmt: int | None) -> Iterator[ops.Packed]:
    """Each matrix of ``fmt`` (None: any format), a stack's experts one by one."""
    for p in packed:
        if fmt is not None and p.fmt != fmt:
            continue
        if p.data.dim() == 2:  # a stack [E, words]
            for i in range(p.data.shape[0]):
                yield ops.Packed(p.data[i], p.n, p.k, fmt=p.fmt)
        else:
            yield p


def _budgeted(packed: Iterable[ops.Packed], fmt: int | None, budget_bytes: int | None) -> tuple[list[ops.Packed], int]:
    """Matrices to time a pass over: ``fmt``'s (None: all) up to ``budget_bytes`` (default four times the
    last-level cache), and their bytes."""
    budget = budget_bytes if budget_bytes is not None else 4 * last_level_cache_bytes()
    chosen: list[ops.Packed] = []
    total = 0
    for p in _matrices(packed, fmt):
        if total >= budget:
            break
        chosen.append(p)
        total += p.data.numel() * p.data.element_size()
    return chosen, total


def _alternate(matrices: Sequence[ops.Packed], tokens: int, candidates: Sequence[int],
               apply: Callable[[int], object]) -> dict[int, list[float]]:
    """Seconds of a ``tokens``-token product over ``matrices`` with each candidate applied, ``ROUNDS`` rounds
    taking turns (one thread)."""
    inputs = {p.k: torch.full((tokens, p.k), 0.01) for p in matrices}
    seconds: dict[int, list[float]] = {c: [] for c in candidates}
    for _ in range(ROUNDS):
        for candidate in candidates:
            apply(candidate)
            start = time.perf_counter()
            for p in matrices:
                ops.linear(inputs[p.k], p, threads=1)
            seconds[candidate].append(time.perf_counter() - start)
    return seconds


def _measure(packed: Iterable[ops.Packed], fmt: int | None, budget_bytes: int | None, tokens: int,
             candidates: Sequence[int], get: Callable[[], int], apply: Callable[[int], object]) -> dict[int, float] | None:
    """Time a ``tokens``-token product over ``packed``'s ``fmt`` matrices (see `_budgeted`) with each candidate
    setting, leave the `pick` applied and return each candidate's median bytes/s; None (nothing changed) when
    those weights fit in twice the last-level cache."""
    matrices, total = _budgeted(packed, fmt, budget_bytes)
    if total < 2 * last_level_cache_bytes():
        return None
    before = get()
    try:
        seconds = _alternate(matrices, tokens, candidates, apply)
    finally:
        apply(before)
    apply(pick(seconds))
    return {c: total / statistics.median(ts) for c, ts in seconds.items()}


def calibrate_level(packed: Iterable[ops.Packed], budget_bytes: int | None = None) -> LevelChoice:
    """Choose the prefetch level for this process on ``packed`` (any format; see the module docstring) and set
    it; the first choice stands, later calls return it. ``budget_bytes``: how much of the weights a pass reads
    (default four times the last-level cache)."""
    global _level
    if _level is not None:
        return _level
    configured = os.environ.get(LEVEL_ENV, "").strip().lower()
    if configured:
        if configured not in LEVELS:
            raise ValueError(f"{LEVEL_ENV} must be one of {sorted(LEVELS)}, got {configured!r}")
        set_level(LEVELS[configured])
        _level = LevelChoice(level(), "environment")
        return _level
    measured = _measure(packed, None, budget_bytes, LEVEL_TOKENS, (level(), 1 - level()), level, set_level)
    if measured is None:
        return LevelChoice(level(), "cached weights")  # not kept: a larger model may come later
    _level = LevelChoice(level(), "measured", measured)
    return _level


def calibrate(packed: Iterable[ops.Packed], budget_bytes: int | None = None) -> list[Choice]:
    """Choose the one-token prefetch distance of each panel format among ``packed`` for this process (see the
    module docstring) and set it; a format's first choice stands, later calls return it. ``budget_bytes``:
    how much of the weights a pass reads (default four times the last-level cache). Quantized blocks are not
    read by the loops this tunes and are left out."""
    matrices = list(packed)
    return [_calibrate(matrices, fmt, budget_bytes) for fmt in (ops.F32, ops.BF16)
            if any(p.fmt == fmt for p in matrices)]


def _calibrate(packed: list[ops.Packed], fmt: int, budget_bytes: int | None) -> Choice:
    if fmt in _chosen:
        return _chosen[fmt]
    configured = os.environ.get(ENV, "").strip()
    if configured:
        set_row_prefetch(fmt, int(configured))
        _chosen[fmt] = Choice(fmt, row_prefetch(fmt), "environment")
        return _chosen[fmt]
    current = row_prefetch(fmt)
    candidates = sorted(CANDIDATES, key=lambda d: d != current)  # the distance in use first
    measured = _measure(packed, fmt, budget_bytes, 1, candidates, lambda: row_prefetch(fmt),
                        lambda d: set_row_prefetch(fmt, d))
    if measured is None:
        return Choice(fmt, row_prefetch(fmt), "cached weights")  # not kept: a larger model may come later
    _chosen[fmt] = Choice(fmt, row_prefetch(fmt), "measured", measured)
    return _chosen[fmt]


def current(fmt: int) -> Choice | None:
    """This process's distance for ``fmt`` panels so far (None before a model large enough to measure on)."""
    return _chosen.get(fmt)


def current_level() -> LevelChoice | None:
    """This process's level so far (None before a model large enough to measure on)."""
    return _level
