"""What each backend served recently: block hashes in a bounded LRU with a TTL.

``on_dispatch`` inserts the chain of the prompt sent to a backend; ``match`` tells how many
leading blocks of a chain that backend served within ``ttl_s`` and still remembers, which is
the routing estimate of how much of the prompt its prefix cache holds.

Each backend's index is an ``OrderedDict`` of hash to last-served time in LRU order, capped
at ``max_blocks`` (sized from the backend's KV capacity: an engine cannot hold more). A chain
is inserted deepest block first, so a block is always at least as recent as every block
below it: eviction and expiry remove the tips of chains before their roots, the blocks a
backend remembers for a chain always form a prefix of it, and ``match`` can binary-search
(``O(log n)`` lookups instead of one per block). The index of a backend that restarts or
leaves is dropped (``forget``): its cache is gone. When the backend's engine says it held less
of a prompt than its index matched (``gateway/dispatch/cache_report.py``), it evicted a block
last served at a known time, and an LRU cache evicts the least recently used first: everything
served no later than that goes too (``forget_before``), one pass from the LRU end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """One backend's recently served blocks (see the module docstring)."""

    __slots__ = ("_seen", "max_blocks", "ttl_s")

    def __init__(self, max_blocks: int, ttl_s: float) -> None:
        if max_blocks < 1 or ttl_s <= 0:
            raise ValueError("max_blocks must be >= 1 and ttl_s > 0")
        self.max_blocks = max_blocks
        self.ttl_s = ttl_s
        self._seen: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def insert(self, blocks: Sequence[int], now: float) -> None:
        seen = self._seen
        for block in reversed(blocks[: self.max_blocks]):
            seen[block] = now
            seen.move_to_end(block)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)
        oldest = now - self.ttl_s
        while seen:
            block, at = next(iter(seen.items()))
            if at >= oldest:
                break
            del seen[block]

    def served_at(self, block: int) -> float | None:
        """When ``block`` was last served here (None: not remembered)."""
        return self._seen.get(block)

    def forget_before(self, at: float) -> int:
        """Forget every block last served at or before ``at``; how many were forgotten."""
        seen = self._seen
        forgotten = 0
        while seen:
            block, served = next(iter(seen.items()))
            if served > at:
                break
            del seen[block]
            forgotten += 1
        return forgotten

    def match(self, blocks: Sequence[int], now: float) -> int:
        """How many leading ``blocks`` this backend served within the TTL."""
        seen = self._seen
        oldest = now - self.ttl_s
        lo, hi = 0, len(blocks)  # invariant: blocks[:lo] are held; blocks[hi:] are not
        while lo < hi:
            mid = (lo + hi) // 2
            at = seen.get(blocks[mid])
            if at is not None and at >= oldest:
                lo = mid + 1
            else:
                hi = mid
        return lo


class BackendIndexes:
    """A ``PrefixIndex`` per backend name, made at the first dispatch there."""

    __slots__ = ("_indexes", "ttl_s")

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._indexes: dict[str, PrefixIndex] = {}

    def match(self, backend: str, blocks: Sequence[int], now: float) -> int:
        index = self._indexes.get(backend)
        return index.match(blocks, now) if index is not None and blocks else 0

    def insert(self, backend: str, max_blocks: int, blocks: Sequence[int], now: float) -> None:
        index = self._indexes.get(backend)
        if index is None:
            index = self._indexes[backend] = PrefixIndex(max_blocks, self.ttl_s)
        index.insert(blocks, now)

    def served_at(self, backend: str, block: int) -> float | None:
        index = self._indexes.get(backend)
        return index.served_at(block) if index is not None else None

    def forget_before(self, backend: str, at: float) -> int:
        index = self._indexes.get(backend)
        return index.forget_before(at) if index is not None else 0

    def size(self, backend: str) -> int:
        index = self._indexes.get(backend)
        return len(index) if index is not None else 0

    def forget(self, backend: str) -> None:
        self._indexes.pop(backend, None)
