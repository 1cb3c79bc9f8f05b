"""Block allocator: reference counts, free list order, prefix-hash reuse."""

from __future__ import annotations

import pytest

from engine.blocks import BlockAllocator, OutOfBlocks


def test_allocate_and_free_return_blocks_to_the_pool() -> None:
    a = BlockAllocator(4, 2)
    got = a.allocate(3)
    assert len(set(got)) == 3 and a.num_free == 1
    assert all(a.ref_counts[b] == 1 for b in got)
    with pytest.raises(OutOfBlocks):
        a.allocate(2)
    a.free(got)
    assert a.num_free == 4
    with pytest.raises(ValueError):
        a.free([got[0]])


def test_blocks_needed_rounds_up() -> None:
    a = BlockAllocator(8, 4)
    assert [a.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def _fill(a: BlockAllocator, tokens: list[int]) -> list[int]:
    """Allocate blocks for ``tokens`` and register every full block, as the scheduler does."""
    blocks = a.allocate(a.blocks_needed(len(tokens)))
    parent = None
    for i in range(len(tokens) // a.block_size):
        parent = a.register(blocks[i], parent, tokens[i * a.block_size:(i + 1) * a.block_size])
    return blocks


def test_prefix_lookup_matches_only_full_blocks_and_leaves_one_token() -> None:
    a = BlockAllocator(16, 4)
    prompt = list(range(10))
    blocks = _fill(a, prompt)
    # same first 8 tokens, different tail: two full blocks hit
    assert a.lookup_prefix([*prompt[:8], 99, 98]) == blocks[:2]
    # exactly 8 tokens: only the first block may hit, so one token is left to compute
    assert a.lookup_prefix(prompt[:8]) == blocks[:1]
    # a different first block breaks the chain even if the second matches
    assert a.lookup_prefix([7, *prompt[1:]]) == []


def test_shared_blocks_are_refcounted_and_survive_until_evicted() -> None:
    a = BlockAllocator(4, 2)
    blocks = _fill(a, [1, 2, 3, 4])
    hits = a.lookup_prefix([1, 2, 3, 4, 5])
    assert hits == blocks
    a.acquire(hits)
    assert [a.ref_counts[b] for b in blocks] == [2, 2]
    a.free(blocks)
    a.free(blocks)
    assert a.num_free == 4
    # freed blocks keep their hash: a later request still hits them
    hits = a.lookup_prefix([1, 2, 3, 4, 5])
    assert hits == blocks
    assert a.num_free_after_acquire(hits) == 2
    a.acquire(hits)
    assert a.num_free == 2
    a.free(hits)
    # allocating every block evicts the cached ones
    a.allocate(4)
    assert a.lookup_prefix([1, 2, 3, 4, 5]) == []


def test_prefix_caching_can_be_disabled() -> None:
    a = BlockAllocator(8, 2, enable_prefix_caching=False)
    _fill(a, [1, 2, 3, 4])
    assert a.lookup_prefix([1, 2, 3, 4, 5]) == []
