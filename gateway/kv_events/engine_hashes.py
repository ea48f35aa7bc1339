"""vLLM's prefix-cache block hashes, computed in the gateway for a request's token ids.

**Why.** The KV-event feeds (``subscriber.py``) fill a per-backend index keyed by the hashes the
engine itself computed (``block_index.py``). To ask that index "how much of this request does
backend B hold?", the gateway must compute, for the request, the very hashes the engine will:
then a lookup is exact, with no shadow tree of guesses beside the engine's own cache. llm-d's
precise prefix-cache scorer does the same, configured with the engines' hash seed and block size.

**The algorithm** (vLLM ``vllm/v1/core/kv_cache_utils.py`` and ``vllm/utils/hashing.py``):

* ``hash_fn`` is the engine's ``--prefix-caching-hash-algo``: ``sha256_cbor`` (SHA-256 of the
  canonical CBOR of the object; reproducible across languages, what llm-d requires),
  ``xxhash_cbor`` (xxh3-128 of the same CBOR), ``sha256`` (SHA-256 of the pickle, protocol
  ``HIGHEST_PROTOCOL``; vLLM's default) and ``xxhash`` (xxh3-128 of the pickle);
* ``NONE_HASH = hash_fn(PYTHONHASHSEED)``, the engine's environment variable as a string;
* block ``i`` (tokens ``[i*B, (i+1)*B)``, full blocks only) hashes
  ``hash_fn((parent, tuple(block_token_ids), extra_keys))`` with ``parent`` the hash of block
  ``i-1`` (``NONE_HASH`` for the first), and ``extra_keys`` None or a tuple: the LoRA adapter's
  name (every block), then the request's ``cache_salt`` on the first block only (when non-empty);
* a KV event carries each hash as these bytes, or, under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
  as the int of their low 64 bits (``int.from_bytes(h, "big") & (2**64 - 1)``):
  ``EngineHashing.int_hashes``.

**What breaks it** (the gateway then computes hashes no engine holds; nothing is wrong, the index
just never matches):

* the engine's ``PYTHONHASHSEED`` unset: its ``NONE_HASH`` is random per start and no one can
  reproduce its hashes (do not configure hashing for such an engine);
* a different hash algorithm or block size than the engine's (``--block-size``; for a hybrid
  model, the engine's hash block size), or int hashes one side only;
* different token ids: the prompt's ids must be the engine's own (``engine_tokens.py``);
* what is not modelled: multimodal inputs (vLLM adds each item's hash and offset to the keys of
  the blocks it covers), prompt embeddings, and vLLM's ``sha256_msgpack``/``xxhash_msgpack``.
  ``sha256`` and ``xxhash`` hash a pickle: CPython's, stable across its versions for these types
  but not promised to be.

**Cost.** The CBOR of a block is a fixed shape: ``[parent: bytes, tokens: array of uint,
extra: null | array]``. Its bytes are the 3-array head, the parent's byte-string head and bytes,
the token array's head, each token's own encoding and the extra keys' encoding, concatenated:
CBOR encodes an array as its head followed by its items, and canonical mode changes only maps,
sets and floats, none of which occur here. Each piece is encoded by ``cbor2`` itself (a token's
bytes once per distinct id, then from a dictionary), so the message is ``cbor2.dumps(...,
canonical=True)`` byte for byte (``tests/kv_events/test_engine_hashes.py`` checks it over
generated inputs). A 2,000-token prompt costs ~0.15-0.2 ms (125 blocks of 16; the SHA-256 itself
~0.3 us a block), against ~0.3-0.5 ms for ``cbor2.dumps`` per block.

Usage::

    hasher = EngineBlockHasher(EngineHashing(seed="0", block_size=16))
    hasher.block_hashes(token_ids, cache_salt=body.get("cache_salt"))   # one hash per full block
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import cbor2
import xxhash

from gateway.kv_events.wire import BlockHash

INT_HASH_MASK = (1 << 64) - 1
"""The bits of a hash an engine sends under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``."""


class HashAlgorithm(StrEnum):
    """vLLM's ``--prefix-caching-hash-algo`` values the gateway reproduces (vLLM's names)."""

    SHA256_CBOR = "sha256_cbor"
    XXHASH_CBOR = "xxhash_cbor"
    SHA256 = "sha256"
    XXHASH = "xxhash"

    @property
    def uses_cbor(self) -> bool:
        return self in (HashAlgorithm.SHA256_CBOR, HashAlgorithm.XXHASH_CBOR)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineHashing:
    """How an engine hashes its blocks: the settings a gateway must share with it.

    ``EngineHashing(seed="0")`` is an engine started with ``PYTHONHASHSEED=0``,
    ``--prefix-caching-hash-algo sha256_cbor`` and the default ``--block-size 16``, sending
    bytes hashes. ``seed`` is the engine's ``PYTHONHASHSEED`` exactly as set (a string).
    """

    algorithm: HashAlgorithm = HashAlgorithm.SHA256_CBOR
    seed: str
    block_size: int = 16
    int_hashes: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithm", HashAlgorithm(self.algorithm))
        if not isinstance(self.seed, str):
            raise TypeError(f"seed must be the engine's PYTHONHASHSEED as a string, not {type(self.seed).__name__}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, not {self.block_size!r}")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    digest: bytes = xxhash.xxh3_128_digest(data)
    return digest


_DIGESTS: dict[HashAlgorithm, Callable[[bytes], bytes]] = {
    HashAlgorithm.SHA256_CBOR: _sha256,
    HashAlgorithm.XXHASH_CBOR: _xxh3_128,
    HashAlgorithm.SHA256: _sha256,
    HashAlgorithm.XXHASH: _xxh3_128,
}


def _cbor(obj: Any) -> bytes:
    encoded: bytes = cbor2.dumps(obj, canonical=True)
    return encoded


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class _TokenEncodings(dict[int, bytes]):
    """A token id's CBOR bytes, encoded by ``cbor2`` on first sight and kept.

    Bounded by the vocabulary (about 100 bytes an id seen: a few MB for the ids real prompts use).
    """

    def __missing__(self, token_id: int) -> bytes:
        encoded = _cbor(token_id)
        self[token_id] = encoded
        return encoded


class EngineBlockHasher:
    """Computes an engine's block hashes for token ids (module docstring: algorithm and limits).

    Pure and deterministic; the only state is the cache of token encodings.
    """

    __slots__ = ("_array_head", "_digest", "_encodings", "_message_head", "hashing", "none_hash")

    def __init__(self, hashing: EngineHashing) -> None:
        self.hashing = hashing
        self._digest = _DIGESTS[hashing.algorithm]
        serialize = _cbor if hashing.algorithm.uses_cbor else _pickle
        self.none_hash: bytes = self._digest(serialize(hashing.seed))
        # Heads written by cbor2 itself: a 3-array, then the parent's byte string (every parent is
        # a digest of the none hash's length), and an array of block_size items (0 encodes as 1 byte).
        size = len(self.none_hash)
        self._message_head = b"\x83" + _cbor(bytes(size))[:-size]
        self._array_head = _cbor((0,) * hashing.block_size)[: -hashing.block_size]
        self._encodings = _TokenEncodings()

    def block_hashes(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        parent: bytes | None = None,
    ) -> tuple[BlockHash, ...]:
        """The hashes of the full blocks of ``token_ids``, in order (a partial last block has none).

        ``parent``: the (bytes) hash of the block before ``token_ids``, whose chain they continue
        (an engine's blocks filled by generated tokens); the salt then has no part, as it is only
        in a request's first block."""
        lora_keys = () if lora_name is None else (lora_name,)
        first_keys = (*lora_keys, cache_salt) if cache_salt and parent is None else lora_keys
        extra_first = first_keys or None
        extra_rest = lora_keys or None
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        root = self.none_hash if parent is None else parent
        if self.hashing.algorithm.uses_cbor:
            chain = self._cbor_chain(ids, _cbor(extra_first), _cbor(extra_rest), root)
        else:
            chain = self._pickle_chain(ids, extra_first, extra_rest, root)
        if self.hashing.int_hashes:
            return tuple(int.from_bytes(h, "big") & INT_HASH_MASK for h in chain)
        return tuple(chain)

    def _cbor_chain(self, ids: list[int], tail_first: bytes, tail_rest: bytes, root: bytes) -> list[bytes]:
        size = self.hashing.block_size
        digest, join, encode = self._digest, b"".join, self._encodings.__getitem__
        head, array_head = self._message_head, self._array_head
        chain: list[bytes] = []
        parent, tail = root, tail_first
        for start in range(0, len(ids) - size + 1, size):
            parent = digest(join((head, parent, array_head, *map(encode, ids[start : start + size]), tail)))
            chain.append(parent)
            tail = tail_rest
        return chain

    def _pickle_chain(self, ids: list[int], extra_first: Any, extra_rest: Any, root: bytes) -> list[bytes]:
        size, digest = self.hashing.block_size, self._digest
        chain: list[bytes] = []
        parent, extra = root, extra_first
        for start in range(0, len(ids) - size + 1, size):
            parent = digest(_pickle((parent, tuple(ids[start : start + size]), extra)))
            chain.append(parent)
            extra = extra_rest
        return chain
