"""Paged KV cache with automatic prefix caching, after vLLM V1's block pool.

* The cache holds ``num_blocks`` blocks of ``block_size`` tokens.
* A full block is identified by a hash chained over token ids: ``h_i = H(h_{i-1}, tokens_i)``,
  with ``h_{-1} = H(cache_salt)``. The same prefix under another salt therefore never hits,
  which is what vLLM's ``cache_salt`` request field is for.
* A block is *referenced* while a running request uses it. Unreferenced blocks sit in a free
  queue in LRU order; those holding a hash are still *cached* and can be hit again until the
  allocator evicts them from the front of the queue (least recently freed first).
* Usage is ``1 − free/total``, like ``vllm:kv_cache_usage_perc``: cached but unreferenced blocks
  count as free because they can be evicted at any time.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

_NO_HASH = -1


def salt_root(cache_salt: str | None) -> int:
    """Seed of a request's hash chain."""
    return xxhash.xxh64_intdigest(b"salt:" + (cache_salt or "").encode())


def chain_hashes(parent: int, token_ids: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    """Hashes of the full blocks ``start..stop-1`` of `token_ids`, continuing from `parent`."""
    hashes: list[int] = []
    for block in range(start, stop):
        chunk = array("I", token_ids[block * block_size : (block + 1) * block_size]).tobytes()
        parent = xxhash.xxh64_intdigest(parent.to_bytes(8, "little") + chunk)
        hashes.append(parent)
    return hashes


class KVCache:
    """Block allocator with reference counts, a hash index and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._hash_of = [_NO_HASH] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix of `hashes`; no side effect."""
        blocks: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, blocks: Sequence[int]) -> None:
        """Reference blocks found by `lookup` (taking them off the free queue)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks, evicting cached ones in LRU order; None if too few are free."""
        if count > len(self._free):
            return None
        blocks: list[int] = []
        for _ in range(count):
            block, _unused = self._free.popitem(last=False)
            h = self._hash_of[block]
            if h != _NO_HASH:
                del self._cached[h]
                self._hash_of[block] = _NO_HASH
                self.evictions += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; the tail of a sequence is queued for eviction first."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def commit(self, block: int, block_hash: int) -> None:
        """Publish a full, computed block under its hash (first writer wins, as in vLLM)."""
        if block_hash not in self._cached and self._hash_of[block] == _NO_HASH:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash
