"""vLLM's block hashes computed by the gateway (``gateway/kv_events/engine_hashes.py``).

The reference below is the algorithm written out from vLLM's description, independently of the
module: ``hash_fn((parent or NONE_HASH, tuple(block), extra_keys))`` with ``hash_fn`` the
SHA-256 or xxh3-128 of ``cbor2.dumps(obj, canonical=True)`` or of the pickle, and extra keys
``(lora_name?, cache_salt if first block?)`` or None. The module hand-assembles the CBOR message;
the generated cases hold it to ``cbor2.dumps`` of the whole object.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.kv_events.engine_hashes import EngineBlockHasher, EngineHashing, HashAlgorithm
from gateway.kv_events.wire import BlockHash

SEED = "0"


def reference_hash_fn(algorithm: str) -> Callable[[Any], bytes]:
    def serialize(obj: Any) -> bytes:
        if algorithm.endswith("_cbor"):
            encoded: bytes = cbor2.dumps(obj, canonical=True)
            return encoded
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def digest(data: bytes) -> bytes:
        if algorithm.startswith("sha256"):
            return hashlib.sha256(data).digest()
        result: bytes = xxhash.xxh3_128_digest(data)
        return result

    return lambda obj: digest(serialize(obj))


def reference_chain(
    token_ids: Sequence[int],
    *,
    algorithm: str = "sha256_cbor",
    seed: str = SEED,
    block_size: int = 16,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> tuple[bytes, ...]:
    hash_fn = reference_hash_fn(algorithm)
    none_hash = hash_fn(seed)
    parent: bytes | None = None
    chain = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys: list[str] = [lora_name] if lora_name is not None else []
        if start == 0 and cache_salt:
            keys.append(cache_salt)
        block = tuple(token_ids[start : start + block_size])
        parent = hash_fn((parent or none_hash, block, tuple(keys) if keys else None))
        chain.append(parent)
    return tuple(chain)


def raw(hashes: Sequence[BlockHash]) -> list[bytes]:
    assert all(isinstance(h, bytes) for h in hashes)
    return [h for h in hashes if isinstance(h, bytes)]


def hasher(**settings: Any) -> EngineBlockHasher:
    return EngineBlockHasher(EngineHashing(seed=settings.pop("seed", SEED), **settings))


def test_the_algorithms_carry_vllms_names() -> None:
    assert {a.value for a in HashAlgorithm} == {"sha256_cbor", "xxhash_cbor", "sha256", "xxhash"}
    assert EngineHashing(seed=SEED).algorithm is HashAlgorithm.SHA256_CBOR


@pytest.mark.parametrize("algorithm", list(HashAlgorithm), ids=lambda a: f"{a.value} hashes as the reference")
def test_each_algorithm_matches_the_reference_on_known_inputs(algorithm: HashAlgorithm) -> None:
    rng = random.Random(7)
    token_ids = [rng.randrange(0, 200_000) for _ in range(100)] + [0, 23, 24, 255, 256, 65_535, 65_536, 2**32]
    for salt, lora in [(None, None), ("salt", None), (None, "adapter"), ("salt", "adapter")]:
        got = hasher(algorithm=algorithm, block_size=8).block_hashes(token_ids, cache_salt=salt, lora_name=lora)
        want = reference_chain(token_ids, algorithm=algorithm.value, block_size=8, cache_salt=salt, lora_name=lora)
        assert got == want
        assert len(got) == len(token_ids) // 8


@pytest.mark.parametrize("algorithm", list(HashAlgorithm), ids=lambda a: f"{a.value}'s none hash is hash_fn(seed)")
def test_the_none_hash_is_the_hash_of_the_seed_string(algorithm: HashAlgorithm) -> None:
    assert hasher(algorithm=algorithm, seed="1234").none_hash == reference_hash_fn(algorithm.value)("1234")
    assert hasher(algorithm=algorithm, seed="1234").none_hash != hasher(algorithm=algorithm, seed="1235").none_hash


def test_known_answer_sha256_cbor_seed_0_block_4_salted() -> None:
    """Computed from the description above, and pinned: a change in cbor2's encoding fails here."""
    hash_fn = reference_hash_fn("sha256_cbor")
    none_hash = hash_fn("0")
    first = hash_fn((none_hash, (1, 2, 3, 4), ("abc",)))
    second = hash_fn((first, (5, 6, 7, 8), None))
    got = hasher(block_size=4).block_hashes(list(range(1, 10)), cache_salt="abc")
    assert got == (first, second)
    assert none_hash.hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    assert [h.hex() for h in raw(got)] == [
        "6f2344dbdb2c24bf8521db6611988112ef59f7b611ad1c399d70afc01c824a51",
        "8bbc649e406244d60a2c1b060f684a52bb5d09d78656f3c85f424f670f6969ba",
    ]


def test_a_vector_published_by_an_independent_implementation() -> None:
    """An independent Rust implementation of vLLM's sha256_cbor pins the none hash for seed "0"
    (above) and sha256(cbor((NONE_HASH, (1, 2, 3), ("image_hash:abc123",)))): the same message
    as a 3-token block with a one-key extra tuple, here a LoRA name."""
    got = hasher(block_size=3).block_hashes([1, 2, 3], lora_name="image_hash:abc123")
    assert raw(got)[0].hex() == "4186905812c6277a0d7d00e27740140ea7d60be1d75066097331b40dc144b40d"


def test_the_salt_keys_the_first_block_only() -> None:
    hash_fn = reference_hash_fn("sha256_cbor")
    token_ids = list(range(12))
    salted = hasher(block_size=4).block_hashes(token_ids, cache_salt="tenant-a")
    assert salted[0] == hash_fn((hash_fn(SEED), (0, 1, 2, 3), ("tenant-a",)))
    assert salted[1] == hash_fn((salted[0], (4, 5, 6, 7), None))
    assert salted[2] == hash_fn((salted[1], (8, 9, 10, 11), None))
    assert hasher(block_size=4).block_hashes(token_ids, cache_salt="") == hasher(block_size=4).block_hashes(token_ids)


def test_two_salts_give_disjoint_chains() -> None:
    token_ids = list(range(64))
    a = hasher(block_size=4).block_hashes(token_ids, cache_salt="tenant-a")
    b = hasher(block_size=4).block_hashes(token_ids, cache_salt="tenant-b")
    plain = hasher(block_size=4).block_hashes(token_ids)
    assert len(a) == len(b) == len(plain) == 16
    assert not set(a) & set(b)
    assert not set(a) & set(plain)


def test_the_lora_name_keys_every_block_before_the_salt() -> None:
    hash_fn = reference_hash_fn("sha256_cbor")
    token_ids = list(range(8))
    got = hasher(block_size=4).block_hashes(token_ids, cache_salt="s", lora_name="adapter")
    assert got[0] == hash_fn((hash_fn(SEED), (0, 1, 2, 3), ("adapter", "s")))
    assert got[1] == hash_fn((got[0], (4, 5, 6, 7), ("adapter",)))
    assert not set(got) & set(hasher(block_size=4).block_hashes(token_ids, cache_salt="s"))


@pytest.mark.parametrize("algorithm", list(HashAlgorithm), ids=lambda a: f"{a.value} as ints")
def test_int_hashes_are_the_low_64_bits_big_endian(algorithm: HashAlgorithm) -> None:
    token_ids = list(range(40))
    as_bytes = hasher(algorithm=algorithm, block_size=8).block_hashes(token_ids)
    as_ints = hasher(algorithm=algorithm, block_size=8, int_hashes=True).block_hashes(token_ids)
    assert as_ints == tuple(int.from_bytes(h, "big") & (2**64 - 1) for h in raw(as_bytes))
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in as_ints)


def test_a_partial_last_block_is_not_hashed() -> None:
    assert len(hasher(block_size=4).block_hashes(list(range(7)))) == 1
    assert len(hasher(block_size=4).block_hashes(list(range(8)))) == 2
    assert hasher(block_size=4).block_hashes(list(range(3))) == ()
    assert hasher(block_size=4).block_hashes(list(range(7)))[0] == hasher(block_size=4).block_hashes([0, 1, 2, 3])[0]


def test_any_sequence_of_ids_is_accepted() -> None:
    token_ids = list(range(20))
    assert hasher(block_size=5).block_hashes(tuple(token_ids)) == hasher(block_size=5).block_hashes(token_ids)


def test_settings_are_checked_at_construction() -> None:
    assert EngineHashing(seed="0", algorithm="xxhash_cbor").algorithm is HashAlgorithm.XXHASH_CBOR  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sha256_msgpack"):
        EngineHashing(seed="0", algorithm="sha256_msgpack")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        EngineHashing(seed="0", block_size=0)
    with pytest.raises(TypeError, match="PYTHONHASHSEED"):
        EngineHashing(seed=0)  # type: ignore[arg-type]


token_id = st.one_of(st.integers(0, 2**16), st.integers(0, 2**64 - 1), st.integers(0, 2**70))


@settings(max_examples=300, deadline=None)
@given(
    token_ids=st.lists(token_id, max_size=120),
    block_size=st.integers(1, 30),
    cache_salt=st.none() | st.text(max_size=8),
    lora_name=st.none() | st.text(max_size=8),
    algorithm=st.sampled_from([HashAlgorithm.SHA256_CBOR, HashAlgorithm.XXHASH_CBOR]),
)
def test_the_assembled_cbor_is_cbor2s_own(
    token_ids: list[int], block_size: int, cache_salt: str | None, lora_name: str | None, algorithm: HashAlgorithm
) -> None:
    """Equal digests of every block over generated ids (any width: 1 to 9 bytes and bignums),
    block sizes (array heads of 1 and 2 bytes) and keys: the message is cbor2.dumps's."""
    got = hasher(algorithm=algorithm, block_size=block_size).block_hashes(
        token_ids, cache_salt=cache_salt, lora_name=lora_name
    )
    want = reference_chain(
        token_ids, algorithm=algorithm.value, block_size=block_size, cache_salt=cache_salt, lora_name=lora_name
    )
    assert got == want


@settings(max_examples=200, deadline=None)
@given(
    token_ids=st.lists(st.integers(0, 200_000), max_size=80),
    cut=st.integers(0, 80),
    block_size=st.integers(1, 8),
    cache_salt=st.none() | st.text(min_size=1, max_size=4),
)
def test_the_chain_of_a_prefix_is_a_prefix_of_the_chain(
    token_ids: list[int], cut: int, block_size: int, cache_salt: str | None
) -> None:
    hashes = hasher(block_size=block_size)
    whole = hashes.block_hashes(token_ids, cache_salt=cache_salt)
    prefix = hashes.block_hashes(token_ids[:cut], cache_salt=cache_salt)
    assert whole[: len(prefix)] == prefix
    assert len(prefix) == min(cut, len(token_ids)) // block_size


def test_cost_of_a_2000_token_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    """Measured, printed, and held to 1 ms (best of several runs; ~0.15-0.2 ms on the dev machine)."""
    rng = random.Random(1)
    token_ids = [rng.randrange(0, 150_000) for _ in range(2000)]
    hashes = hasher()
    hashes.block_hashes(token_ids)  # the token encodings, once
    runs = []
    for _ in range(15):
        start = time.perf_counter()
        for _ in range(20):
            hashes.block_hashes(token_ids)
        runs.append((time.perf_counter() - start) / 20)
    reference_start = time.perf_counter()
    reference_chain(token_ids)
    reference = time.perf_counter() - reference_start
    with capsys.disabled():
        print(
            f"\nengine block hashes, 2,000 tokens (125 blocks of 16, sha256_cbor): {min(runs) * 1e6:.0f} us"
            f" (cbor2.dumps per block: {reference * 1e6:.0f} us)"
        )
    assert min(runs) < 1e-3


def test_a_chain_continued_from_its_last_hash_is_the_rest_of_the_whole_chain() -> None:
    """Blocks filled later (an engine's generated tokens) continue the request's chain: no salt there."""
    hasher = EngineBlockHasher(EngineHashing(algorithm=HashAlgorithm.SHA256_CBOR, seed="0", block_size=4))
    ids = list(range(1, 21))
    whole = hasher.block_hashes(ids, cache_salt="abc")
    head = hasher.block_hashes(ids[:8], cache_salt="abc")
    parent = head[-1]
    assert isinstance(parent, bytes)
    assert head + hasher.block_hashes(ids[8:], cache_salt="abc", parent=parent) == whole
