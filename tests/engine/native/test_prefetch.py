"""The one-token products' prefetch distance (`engine.native.prefetch`): set at run time without changing a bit
of any result, chosen by measurement only when it is clearly faster, measured once per process and only on
weights larger than the cache, and settable by the environment."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.native import ops, prefetch


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts undecided and leaves the library's distance as it found it."""
    before = ops.row_prefetch()
    monkeypatch.setattr(prefetch, "_chosen", None)
    monkeypatch.delenv(prefetch.ENV, raising=False)
    yield
    ops.set_row_prefetch(before)


def test_the_distance_is_set_rounded_to_a_line_and_never_negative() -> None:
    ops.set_row_prefetch(8192)
    assert ops.set_row_prefetch(1000) == 8192
    assert ops.row_prefetch() == 960
    ops.set_row_prefetch(-5)
    assert ops.row_prefetch() == 0


@pytest.mark.parametrize("bf16", [False, True])
def test_results_do_not_depend_on_the_distance(bf16: bool, threads: int) -> None:
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(300, 1024, generator=g), torch.randn(7, 1024, generator=g)
    packed = ops.pack(w, bf16=bf16)
    outputs = []
    for distance in (0, 64, 8192, 1 << 20):
        ops.set_row_prefetch(distance)
        outputs.append(torch.cat([ops.linear(x[i:i + 1], packed) for i in range(7)]))
    assert all(torch.equal(o, outputs[0]) for o in outputs[1:])


def test_pick_keeps_the_compiled_distance_unless_another_is_clearly_faster() -> None:
    compiled = prefetch.COMPILED
    assert prefetch.pick({compiled: [1.0, 1.0, 1.0], 0: [0.90, 0.91, 2.0]}) == 0  # medians 1.0 vs 0.91
    assert prefetch.pick({compiled: [1.0, 1.0, 1.0], 0: [0.98, 0.99, 0.5]}) == compiled  # 2% is within MARGIN
    assert prefetch.pick({compiled: [0.8, 0.8, 0.8], 0: [1.0, 1.0, 1.0]}) == compiled
    assert prefetch.pick({compiled: [1.2, 1.3, 1.2], 0: [1.0, 1.1, 1.0], 4096: [1.1, 1.1, 1.1]}) == 0


def _stack(e: int = 4, n: int = 256, k: int = 512) -> ops.Packed:
    return ops.pack(torch.randn(e, n, k, generator=torch.Generator().manual_seed(1)))


def test_weights_that_fit_in_the_cache_are_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "last_level_cache_bytes", lambda: 64 << 20)
    ops.set_row_prefetch(4096)
    choice = prefetch.calibrate([_stack()])
    assert (choice.reason, choice.distance) == ("cached weights", 4096)
    assert prefetch.current() is None  # undecided: a larger model later still measures


def test_a_measured_choice_is_one_of_the_candidates_and_kept_for_the_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "last_level_cache_bytes", lambda: 256 << 10)  # 2 MiB of panels: 8x this
    timed: list[int] = []
    real_pick = prefetch.pick

    def pick(seconds: dict[int, list[float]]) -> int:
        timed.extend(len(ts) for ts in seconds.values())
        return real_pick(seconds)

    monkeypatch.setattr(prefetch, "pick", pick)
    quantized = ops.pack_blocks(torch.zeros(64, 2 * 34, dtype=torch.uint8), "q8_0")  # skipped: blocks
    choice = prefetch.calibrate([quantized, _stack()])
    assert choice.reason == "measured" and choice.distance in prefetch.CANDIDATES
    assert timed == [prefetch.ROUNDS] * len(prefetch.CANDIDATES)
    assert set(choice.rates) == set(prefetch.CANDIDATES) and all(r > 0 for r in choice.rates.values())
    assert ops.row_prefetch() == choice.distance
    assert "measured" in choice.describe() and "GB/s" in choice.describe()
    ops.set_row_prefetch(123 * 64)
    assert prefetch.calibrate([_stack()]) is choice  # decided once: not measured again, not reset
    assert ops.row_prefetch() == 123 * 64


def test_the_environment_sets_the_distance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(prefetch.ENV, "0")
    choice = prefetch.calibrate([_stack()])
    assert (choice.distance, choice.reason) == (0, "environment") and ops.row_prefetch() == 0
    assert choice.describe() == "one-token weight prefetch off (environment)"
