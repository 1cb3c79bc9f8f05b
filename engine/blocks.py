"""Paged KV-cache bookkeeping: a pure-Python block allocator with reference counts, a
free list, and prefix-hash reuse of full blocks.

A *block* holds the K/V of ``block_size`` consecutive tokens of one or more sequences (the
tensors themselves live in the runner). A full block whose tokens are known is hashed
together with the hash of the block before it, so two requests sharing a prompt prefix
can share its blocks (the second one skips computing them). Freed blocks keep their
hash and stay reusable until the allocator hands them out again, oldest freed first.

Plain Python: no torch, no model, nothing web/db.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq


def block_hash(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """Hash of one full block given the hash of the block before it (the root for the first)."""
    return hash((parent_hash, tuple(token_ids)))


def prefix_root(salt: object = None) -> int | None:
    """The "parent" of a sequence's first block. K/V depend on more than the tokens when the
    computation differs (e.g. the number of experts per token), so such settings salt the chain."""
    return None if salt is None else hash(("prefix-root", salt))


class OutOfBlocks(RuntimeError):
    """More blocks were asked for than are free (callers check ``num_free`` first)."""


class BlockAllocator:
    """Reference-counted blocks ``0..num_blocks-1`` with a prefix cache over full blocks."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # free blocks, oldest freed first; an OrderedDict so a cache hit can revive one in O(1)
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: dict[int, int] = {}            # block id -> hash (full, computed blocks)
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._block_of: dict[int, int] = {}           # hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------
    def lookup_prefix(self, token_ids: Seq[int], root: int | None = None) -> list[int]:
        """Cached blocks covering a leading run of full blocks of ``token_ids``.

        Only blocks lying entirely within the first ``len(token_ids) - 1`` tokens are
        matched, so at least one token is always left to compute (its logits give the
        next token). ``root`` (see `prefix_root`) separates caches whose K/V differ.
        Reference counts are not touched: call ``acquire`` to take them.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = root
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            block = self._block_of.get(h)
            if block is None or self._tokens_of.get(block) != chunk:
                break
            hits.append(block)
            parent = h
        return hits

    def num_free_after_acquire(self, block_ids: Seq[int]) -> int:
        """Free blocks left once ``block_ids`` (cache hits, possibly in the free list) are taken."""
        return self.num_free - sum(1 for b in block_ids if b in self._free)

    def acquire(self, block_ids: Seq[int]) -> None:
        """Take a reference on cached blocks (reviving freed ones)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def register(self, block_id: int, parent_hash: int | None, token_ids: Seq[int]) -> int:
        """Record that ``block_id`` is full and holds ``token_ids``; returns its hash."""
        chunk = tuple(token_ids)
        if len(chunk) != self.block_size:
            raise ValueError("only full blocks can be registered")
        h = block_hash(parent_hash, chunk)
        if self.enable_prefix_caching and h not in self._block_of:
            self._block_of[h] = block_id
            self._hash_of[block_id] = h
            self._tokens_of[block_id] = chunk
        return h

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with reference count 1 (evicting their old cache entries)."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Seq[int]) -> None:
        """Drop one reference per block; blocks reaching zero go to the free list.

        Frees in reverse so that a sequence's deepest blocks are evicted before the
        shared prefix blocks it started from.
        """
        for b in reversed(block_ids):
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed more often than taken")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def _evict(self, block_id: int) -> None:
        h = self._hash_of.pop(block_id, None)
        self._tokens_of.pop(block_id, None)
        if h is not None and self._block_of.get(h) == block_id:
            del self._block_of[h]
