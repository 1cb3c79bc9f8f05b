"""The kernels' prefetch knobs (`engine.native.prefetch`), the level every kernel prefetches weights into and the
one-token products' distance: set at run time without changing a bit of any result, chosen by measurement only
when clearly faster, measured once per process and only on weights larger than the cache, settable by the
environment."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.native import ops, prefetch
from engine.quant import quantize


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts undecided and leaves the library's distance as it found it."""
    before = {fmt: prefetch.row_prefetch(fmt) for fmt in (ops.F32, ops.BF16)}
    level = prefetch.level()
    monkeypatch.setattr(prefetch, "_chosen", {})
    monkeypatch.setattr(prefetch, "_level", None)
    monkeypatch.delenv(prefetch.ENV, raising=False)
    monkeypatch.delenv(prefetch.LEVEL_ENV, raising=False)
    yield
    for fmt, distance in before.items():
        prefetch.set_row_prefetch(fmt, distance)
    prefetch.set_level(level)


def test_the_distance_is_set_per_format_rounded_to_a_line_and_never_negative() -> None:
    prefetch.set_row_prefetch(ops.F32, 8192)
    prefetch.set_row_prefetch(ops.BF16, 4096)
    assert prefetch.set_row_prefetch(ops.F32, 1000) == 8192
    assert (prefetch.row_prefetch(ops.F32), prefetch.row_prefetch(ops.BF16)) == (960, 4096)
    prefetch.set_row_prefetch(ops.BF16, -5)
    assert (prefetch.row_prefetch(ops.F32), prefetch.row_prefetch(ops.BF16)) == (960, 0)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        prefetch.set_row_prefetch(ops.Q8_0, 0)


@pytest.mark.parametrize("bf16", [False, True])
def test_results_do_not_depend_on_the_distance(bf16: bool, threads: int) -> None:
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(300, 1024, generator=g), torch.randn(7, 1024, generator=g)
    packed = ops.pack(w, bf16=bf16)
    outputs = []
    for distance in (0, 64, 8192, 1 << 20):
        prefetch.set_row_prefetch(packed.fmt, distance)
        outputs.append(torch.cat([ops.linear(x[i:i + 1], packed) for i in range(7)]))
    assert all(torch.equal(o, outputs[0]) for o in outputs[1:])


def test_pick_keeps_the_current_distance_unless_another_is_clearly_faster() -> None:
    current = prefetch.DISTANCE
    assert prefetch.pick({current: [1.0, 1.0, 1.0], 0: [0.90, 0.91, 2.0]}) == 0  # medians 1.0 vs 0.91
    assert prefetch.pick({current: [1.0, 1.0, 1.0], 0: [0.99, 0.995, 0.5]}) == current  # 1% is within MARGIN
    assert prefetch.pick({current: [0.8, 0.8, 0.8], 0: [1.0, 1.0, 1.0]}) == current
    assert prefetch.pick({current: [1.2, 1.3, 1.2], 0: [1.0, 1.1, 1.0], 4096: [1.1, 1.1, 1.1]}) == 0


def _stack(e: int = 4, n: int = 256, k: int = 512, bf16: bool = False) -> ops.Packed:
    return ops.pack(torch.randn(e, n, k, generator=torch.Generator().manual_seed(1)), bf16=bf16)


def test_weights_that_fit_in_the_cache_are_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "last_level_cache_bytes", lambda: 64 << 20)
    prefetch.set_row_prefetch(ops.F32, 4096)
    [choice] = prefetch.calibrate([_stack()])
    assert (choice.fmt, choice.reason, choice.distance) == (ops.F32, "cached weights", 4096)
    assert prefetch.current(ops.F32) is None  # undecided: a larger model later still measures


def test_each_format_is_measured_once_and_kept_for_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "last_level_cache_bytes", lambda: 256 << 10)  # 2 MiB of fp32 panels: 8x this
    timed: list[int] = []
    firsts: list[int] = []  # the setting each measurement keeps unless the other is clearly faster
    real_pick = prefetch.pick

    def pick(seconds: dict[int, list[float]]) -> int:
        timed.extend(len(ts) for ts in seconds.values())
        firsts.append(next(iter(seconds)))
        return real_pick(seconds)

    monkeypatch.setattr(prefetch, "pick", pick)
    quantized = ops.pack_blocks(torch.zeros(64, 2 * 34, dtype=torch.uint8), "q8_0")  # not measured: blocks
    prefetch.set_row_prefetch(ops.F32, 0)
    prefetch.set_row_prefetch(ops.BF16, prefetch.DISTANCE)
    [f32] = prefetch.calibrate([quantized, _stack()])
    assert (f32.fmt, f32.reason) == (ops.F32, "measured") and f32.distance in prefetch.CANDIDATES
    assert timed == [prefetch.ROUNDS] * len(prefetch.CANDIDATES)
    assert set(f32.rates) == set(prefetch.CANDIDATES) and all(r > 0 for r in f32.rates.values())
    assert prefetch.row_prefetch(ops.F32) == f32.distance
    assert f32.describe().startswith("fp32 one-token weight prefetch") and "GB/s" in f32.describe()
    prefetch.set_row_prefetch(ops.F32, 123 * 64)
    # fp32 decided: not measured again nor reset; bf16 panels (1 MiB here: 4x the cache) measured on their own
    f32_again, bf16 = prefetch.calibrate([_stack(), _stack(bf16=True)])
    assert f32_again is f32 and prefetch.row_prefetch(ops.F32) == 123 * 64
    assert (bf16.fmt, bf16.reason) == (ops.BF16, "measured") and prefetch.row_prefetch(ops.BF16) == bf16.distance
    assert len(timed) == 2 * len(prefetch.CANDIDATES)
    assert firsts == [0, prefetch.DISTANCE]  # the distance in use, as the library had it, is the one to beat


def test_the_environment_sets_the_distance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(prefetch.ENV, "0")
    prefetch.set_row_prefetch(ops.BF16, 8192)
    [choice] = prefetch.calibrate([_stack(bf16=True)])
    assert (choice.distance, choice.reason) == (0, "environment") and prefetch.row_prefetch(ops.BF16) == 0
    assert choice.describe() == "bf16 one-token weight prefetch off (environment)"


def test_the_level_is_set_and_read_back() -> None:
    prefetch.set_level(1)
    assert prefetch.set_level(0) == 1 and prefetch.level() == 0
    with pytest.raises(ValueError, match="0 \\(L1\\) or 1 \\(L2\\)"):
        prefetch.set_level(2)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0", "q4_0"])
def test_results_do_not_depend_on_the_level(fmt: str, threads: int) -> None:
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(200, 1024, generator=g), torch.randn(9, 1024, generator=g)
    packed = ops.pack(w, bf16=fmt == "bf16") if fmt in ("f32", "bf16") else ops.pack_blocks(quantize(w, fmt), fmt)
    outputs = []
    for level in (0, 1):
        prefetch.set_level(level)
        outputs.append([ops.linear(x[:m], packed) for m in (1, 2, 4, 5, 6, 7, 9)])
    assert all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))


def test_the_level_is_measured_once_on_every_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "last_level_cache_bytes", lambda: 256 << 10)
    timed: list[tuple[int, list[int]]] = []
    real_alternate = prefetch._alternate

    def alternate(matrices: list[ops.Packed], tokens: int, candidates: tuple[int, ...], apply: object) -> object:
        timed.append((tokens, sorted({p.fmt for p in matrices})))
        return real_alternate(matrices, tokens, candidates, apply)  # type: ignore[arg-type]

    monkeypatch.setattr(prefetch, "_alternate", alternate)
    g = torch.Generator().manual_seed(5)
    quantized = ops.pack_blocks(quantize(torch.randn(3, 256, 512, generator=g), "q8_0"), "q8_0")  # 408 KiB
    choice = prefetch.calibrate_level([quantized, _stack(e=1)])  # + 512 KiB of fp32: both formats timed
    assert timed == [(prefetch.LEVEL_TOKENS, [ops.F32, ops.Q8_0])]
    assert choice.reason == "measured" and set(choice.rates) == {0, 1} and prefetch.level() == choice.level
    assert choice.describe().startswith(f"weight prefetch into L{choice.level + 1} (measured on 4-token products")
    prefetch.set_level(1 - choice.level)
    assert prefetch.calibrate_level([_stack()]) is choice and prefetch.level() == 1 - choice.level  # kept, not redone
    assert prefetch.current_level() is choice and len(timed) == 1


def test_the_level_is_left_alone_on_cached_weights_and_set_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "last_level_cache_bytes", lambda: 64 << 20)
    prefetch.set_level(1)
    cached = prefetch.calibrate_level([_stack()])
    assert (cached.level, cached.reason) == (1, "cached weights") and prefetch.current_level() is None
    monkeypatch.setenv(prefetch.LEVEL_ENV, "L1")
    chosen = prefetch.calibrate_level([_stack()])
    assert (chosen.level, chosen.reason, prefetch.level()) == (0, "environment", 0)
    assert chosen.describe() == "weight prefetch into L1 (environment)"
    monkeypatch.setattr(prefetch, "_level", None)
    monkeypatch.setenv(prefetch.LEVEL_ENV, "l3")
    with pytest.raises(ValueError, match="TIERGATE_NATIVE_PREFETCH_LEVEL must be one of"):
        prefetch.calibrate_level([_stack()])
