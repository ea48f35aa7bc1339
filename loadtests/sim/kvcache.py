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

That is the ``pool`` cache scope. ``SlotTable`` models the other kind of engine, llama.cpp's
server, whose reusable prefixes live in its slots (``CacheScope``).
"""

from __future__ import annotations

import enum
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

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


class KVCacheObserver(Protocol):
    """Told of every hash the cache publishes and evicts (the sim's KV events, ``kv_events.py``)."""

    def stored(self, block_hash: int, parent: int | None, token_ids: Sequence[int]) -> None: ...

    def removed(self, block_hash: int) -> None: ...


class KVCache:
    """Block allocator with reference counts, a hash index and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.observer: KVCacheObserver | None = None  # set by ``observe``
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._hash_of = [_NO_HASH] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.evictions = 0

    def observe(self, observer: KVCacheObserver) -> None:
        """Report commits and evictions to ``observer`` from now on."""
        self.observer = observer

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
                if self.observer is not None:
                    self.observer.removed(h)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; the tail of a sequence is queued for eviction first."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def commit(self, block: int, block_hash: int, parent: int | None = None, token_ids: Sequence[int] = ()) -> None:
        """Publish a full, computed block under its hash (first writer wins, as in vLLM); ``parent``
        (the chain's previous hash) and ``token_ids`` only go to the observer, when given."""
        if block_hash not in self._cached and self._hash_of[block] == _NO_HASH:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash
            if self.observer is not None:
                self.observer.stored(block_hash, parent, token_ids)


class CacheScope(enum.Enum):
    """What an engine's prefix cache holds (``Profile.cache_scope``, ``sim --cache-scope``).

    * ``pool``: vLLM's block pool above: a finished sequence's blocks stay cached until evicted
      in LRU order, and any later request (same salt) hits them, whichever slot it runs in.
    * ``slots``: llama.cpp's server without its host prompt cache (``--cache-ram 0``): each of
      ``max_num_seqs`` slots (``--parallel``) holds the tokens of the last sequence it ran; a
      new request goes to the idle slot whose tokens share the largest part of its prompt
      (``--slot-prompt-similarity``, 0.1: common prefix over prompt length above it), else to the
      least recently used idle slot, and reuses only that slot's common prefix
      (``cache_prompt``, on by default). A prefix survives its sequence only until its slot is
      taken by another prompt.
    * ``running``: the strict reading: a slot forgets its tokens when its sequence ends, so only
      a running sequence's prefix can be shared (what the issue's "cache holds only the running
      sequences" says; an upper bound of the loss).
    """

    POOL = "pool"
    SLOTS = "slots"
    RUNNING = "running"


@dataclass(slots=True)
class _Slot:
    salt: int = 0
    tokens: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks of `tokens`
    busy: bool = False
    last_used: int = -1


class SlotTable:
    """llama.cpp's server slots as a prefix cache (``CacheScope.SLOTS`` / ``RUNNING``).

    Selection follows ``server_context::get_available_slot`` (tools/server/server-context.cpp):
    among idle slots holding tokens, the one with the highest ``lcp / len(prompt)`` above
    ``similarity`` wins; otherwise the idle slot used least recently. The reused prefix is that
    slot's common prefix with the prompt (token-exact, as llama.cpp's ``get_common_prefix``),
    never the whole prompt (one token is always computed). A slot's tokens are compared only
    under the same ``cache_salt`` root (vLLM's salt; llama.cpp has none, and unsalted requests
    all share root 0's salt).
    """

    def __init__(self, n_slots: int, block_size: int, *, similarity: float = 0.1, keep_idle: bool = True) -> None:
        if n_slots < 1:
            raise ValueError("a slot table needs at least one slot")
        self.block_size = block_size
        self.similarity = similarity
        self.keep_idle = keep_idle
        self._slots = [_Slot() for _ in range(n_slots)]
        self._uses = 0

    @property
    def num_idle(self) -> int:
        return sum(not s.busy for s in self._slots)

    def common_prefix(self, slot: int, salt: int, tokens: Sequence[int], hashes: Sequence[int]) -> int:
        """Tokens of ``tokens`` (whose full blocks hash to ``hashes``) that ``slot`` holds."""
        held = self._slots[slot]
        if held.salt != salt or not held.tokens:
            return 0
        blocks = 0
        for mine, theirs in zip(hashes, held.hashes, strict=False):
            if mine != theirs:
                break
            blocks += 1
        n = blocks * self.block_size
        limit = min(len(tokens), len(held.tokens))
        while n < limit and tokens[n] == held.tokens[n]:
            n += 1
        return n

    def best(self, salt: int, tokens: Sequence[int], hashes: Sequence[int]) -> tuple[int, int]:
        """(slot, common prefix) that ``take`` would choose; (-1, 0) when every slot is busy."""
        chosen, chosen_lcp, best_sim = -1, 0, 0.0
        for i, slot in enumerate(self._slots):
            if slot.busy or not slot.tokens:
                continue
            lcp = self.common_prefix(i, salt, tokens, hashes)
            sim = lcp / max(1, len(tokens))
            if sim > best_sim and sim > self.similarity:
                chosen, chosen_lcp, best_sim = i, lcp, sim
        if chosen >= 0:
            return chosen, chosen_lcp
        idle = [i for i, s in enumerate(self._slots) if not s.busy]
        if not idle:
            return -1, 0
        lru = min(idle, key=lambda i: self._slots[i].last_used)
        return lru, self.common_prefix(lru, salt, tokens, hashes)

    def take(self, salt: int, tokens: Sequence[int], hashes: Sequence[int]) -> tuple[int, int]:
        """Seat a prompt: (slot, tokens reused from it, at most ``len(tokens) - 1``)."""
        slot, lcp = self.best(salt, tokens, hashes)
        if slot < 0:
            raise RuntimeError("no idle slot")
        held = self._slots[slot]
        held.busy = True
        self._uses += 1
        held.last_used = self._uses
        return slot, min(lcp, max(0, len(tokens) - 1))

    def release(self, slot: int, salt: int, tokens: Sequence[int], hashes: Sequence[int]) -> None:
        """The slot's sequence left: it keeps ``tokens`` (computed so far) unless ``keep_idle`` is off."""
        held = self._slots[slot]
        held.busy = False
        held.salt = salt
        held.tokens = list(tokens) if self.keep_idle else []
        held.hashes = list(hashes[: len(held.tokens) // self.block_size]) if self.keep_idle else []
