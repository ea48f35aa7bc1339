"""Paged KV cache with automatic prefix caching, after vLLM V1's block pool.

* The cache holds ``num_blocks`` blocks of ``block_size`` tokens.
* A full block is identified by a hash chained over token ids: ``h_i = H(h_{i-1}, tokens_i)``,
  with ``h_{-1} = H(cache_salt)``. The same prefix under another salt therefore never hits,
  which is what vLLM's ``cache_salt`` request field is for. The chain is a ``BlockHashing``:
  the simulator's own (``SimHashing``, xxh64, 64-bit ints) unless the engine is told to be a
  vLLM (``VllmHashing``, ``sim --tokenizer``): then vLLM's own block hashes, so that a consumer
  computing vLLM's hashes (the gateway) finds the simulator's blocks under them.
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
import logging
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import xxhash

if TYPE_CHECKING:
    from gateway.kv_events.engine_hashes import EngineBlockHasher

log = logging.getLogger("loadtests.sim.kvcache")

BlockHash = int | bytes
"""A full block's key: the simulator's 64-bit int, or vLLM's digest (bytes)."""


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


class BlockHashing(Protocol):
    """How a cache keys full blocks: a chain over their token ids rooted at the request's salt."""

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int], full_blocks: int, salt: str | None) -> None:
        """Append the hashes of blocks ``len(hashes) .. full_blocks - 1`` of ``token_ids`` (a
        request salted ``salt``) to ``hashes``, its chain so far: each block is hashed once."""
        ...

    def external(self, block_hash: BlockHash) -> BlockHash:
        """``block_hash`` as the KV events publish it."""
        ...


class SimHashing:
    """The simulator's own chain (``chain_hashes`` from ``salt_root``): cheap, 64-bit ints."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int], full_blocks: int, salt: str | None) -> None:
        have = len(hashes)
        if full_blocks > have:
            parent = hashes[-1] if have else salt_root(salt)
            assert isinstance(parent, int)
            hashes.extend(chain_hashes(parent, token_ids, have, full_blocks, self.block_size))

    def external(self, block_hash: BlockHash) -> BlockHash:
        return block_hash


UNSEEDED_WARNING = (
    "PYTHONHASHSEED is not set. This will lead to non-reproducible block-hashes when using CBOR-based hash "
    "functions such as sha256_cbor or xxhash_cbor. Consider setting PYTHONHASHSEED to a fixed value for "
    "reproducibility."
)
"""What vLLM logs (``init_none_hash``) when a CBOR hash has no seed."""


@dataclass(frozen=True, slots=True)
class VllmHashingSpec:
    """vLLM's block hashing as an engine is started with it: ``--prefix-caching-hash-algo``
    (vLLM's default ``sha256``), ``PYTHONHASHSEED`` (None: unset, a random root per engine, as
    each vLLM process draws its own) and ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``."""

    algorithm: str = "sha256"
    seed: str | None = None
    int_hashes: bool = False

    def build(self, block_size: int) -> VllmHashing:
        """One engine's hashing; logs vLLM's warning when unseeded (as each vLLM process does)."""
        from gateway.kv_events.engine_hashes import EngineBlockHasher, EngineHashing, HashAlgorithm

        algorithm = HashAlgorithm(self.algorithm)
        seed = self.seed
        if seed is None:
            if algorithm.uses_cbor:
                log.warning(UNSEEDED_WARNING)
            seed = os.urandom(16).hex()  # vLLM: NONE_HASH = os.urandom(32); here hash_fn of a random seed
        hashing = EngineHashing(algorithm=algorithm, seed=seed, block_size=block_size)  # digests: the chain's keys
        return VllmHashing(EngineBlockHasher(hashing), int_hashes=self.int_hashes)


class VllmHashing:
    """vLLM's own block hashes (``gateway/kv_events/engine_hashes.py``), kept as the digests vLLM
    keys its cache by; ``external`` gives the low 64 bits as an int under ``int_hashes``, as
    vLLM's events do.

    A request's first blocks are hashed from the chain's root, with its ``cache_salt`` in the
    first block's keys; blocks filled later (generated tokens) continue the chain from their
    parent (``block_hashes(..., parent=)``: vLLM's blocks after the first have no extra keys, so a
    chain from the parent is exactly the rest of the request's chain).
    """

    def __init__(self, hasher: EngineBlockHasher, *, int_hashes: bool = False) -> None:
        from gateway.kv_events.engine_hashes import INT_HASH_MASK

        self._first = hasher
        self._block_size = hasher.hashing.block_size
        self._mask = INT_HASH_MASK
        self.int_hashes = int_hashes

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int], full_blocks: int, salt: str | None) -> None:
        have, bs = len(hashes), self._block_size
        if full_blocks <= have:
            return
        if not have:
            hashes.extend(self._first.block_hashes(token_ids[: full_blocks * bs], cache_salt=salt))
            return
        parent = hashes[-1]
        assert isinstance(parent, bytes)
        hashes.extend(self._first.block_hashes(token_ids[have * bs : full_blocks * bs], parent=parent))

    def external(self, block_hash: BlockHash) -> BlockHash:
        if self.int_hashes and isinstance(block_hash, bytes):
            return int.from_bytes(block_hash, "big") & self._mask
        return block_hash


def block_chain(hashing: BlockHashing, token_ids: Sequence[int], full_blocks: int, salt: str | None) -> list[BlockHash]:
    """The hashes of the first ``full_blocks`` blocks of ``token_ids``."""
    hashes: list[BlockHash] = []
    hashing.extend(hashes, token_ids, full_blocks, salt)
    return hashes


class KVCacheObserver(Protocol):
    """Told of every hash the cache publishes and evicts (the sim's KV events, ``kv_events.py``)."""

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> None: ...

    def removed(self, block_hash: BlockHash) -> None: ...


class KVCache:
    """Block allocator with reference counts, a hash index and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, hashing: BlockHashing | None = None) -> None:
        self.observer: KVCacheObserver | None = None  # set by ``observe``
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hashing: BlockHashing = hashing or SimHashing(block_size)  # what the users key blocks by
        self._refs = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
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

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
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
            if h is not None:
                del self._cached[h]
                self._hash_of[block] = None
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

    def commit(
        self, block: int, block_hash: BlockHash, parent: BlockHash | None = None, token_ids: Sequence[int] = ()
    ) -> None:
        """Publish a full, computed block under its hash (first writer wins, as in vLLM); ``parent``
        (the chain's previous hash) and ``token_ids`` only go to the observer, when given."""
        if block_hash not in self._cached and self._hash_of[block] is None:
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
    hashes: list[BlockHash] = field(default_factory=list)  # chained hashes of the full blocks of `tokens`
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

    def common_prefix(self, slot: int, salt: int, tokens: Sequence[int], hashes: Sequence[BlockHash]) -> int:
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

    def best(self, salt: int, tokens: Sequence[int], hashes: Sequence[BlockHash]) -> tuple[int, int]:
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

    def take(self, salt: int, tokens: Sequence[int], hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """Seat a prompt: (slot, tokens reused from it, at most ``len(tokens) - 1``)."""
        slot, lcp = self.best(salt, tokens, hashes)
        if slot < 0:
            raise RuntimeError("no idle slot")
        held = self._slots[slot]
        held.busy = True
        self._uses += 1
        held.last_used = self._uses
        return slot, min(lcp, max(0, len(tokens) - 1))

    def release(self, slot: int, salt: int, tokens: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """The slot's sequence left: it keeps ``tokens`` (computed so far) unless ``keep_idle`` is off."""
        held = self._slots[slot]
        held.busy = False
        held.salt = salt
        held.tokens = list(tokens) if self.keep_idle else []
        held.hashes = list(hashes[: len(held.tokens) // self.block_size]) if self.keep_idle else []
