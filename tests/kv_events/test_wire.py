"""vLLM's KV event batches, encoded by vLLM's own class definitions, decode in the gateway.

The classes below are copied verbatim from vLLM (Apache-2.0, ``vllm/distributed/kv_events.py``;
the ``__hash__`` methods, which play no part in encoding, left out):

* ``V``: vLLM main at commit 0181ea3173e53eea8cf04a86891488e3dc89bb34 (batch and events
  as maps, after vLLM PR #42892), ``ExternalBlockHash`` spelled out as ``bytes | int``; "verbatim" up to ruff's
  spelling of ``Optional``/``Union``, which changes nothing on the wire;
* ``L``: vLLM at commit b4e69e0af33f4698e157a262cc787fe61983cd3d (everything positional,
  ``array_like=True``, int hashes, no ``medium``).

vLLM 0.26 sat between the two (an array batch of map events): the test uses the current
definitions with ``array_like=True`` on the batch only (``V.MixedEventBatch``).
"""

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from gateway.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventDecodeError,
    decode_batch,
    decode_seq,
    encode_seq,
)

ExternalBlockHash = bytes | int  # vllm/v1/core/kv_cache_utils.py


def _vllm_current() -> SimpleNamespace:
    """vLLM main @ 0181ea3173e53eea8cf04a86891488e3dc89bb34, verbatim (in a function, so that the
    class names, which are the tags, are vLLM's; this module evaluates annotations eagerly)."""

    class EventBatch(
        msgspec.Struct,
        omit_defaults=True,
        gc=False,
    ):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(
        msgspec.Struct,
        omit_defaults=True,
        gc=False,
        tag=True,
    ):
        """Base class for all KV cache-related events"""

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int

        lora_id: int | None
        medium: str | None
        lora_name: str | None

        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    # vLLM 0.26: the same events in a positional batch (array_like on EventBatch only).
    class MixedEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return SimpleNamespace(**locals())


def _vllm_legacy() -> SimpleNamespace:
    """vLLM @ b4e69e0af33f4698e157a262cc787fe61983cd3d, verbatim."""

    class EventBatch(
        msgspec.Struct,
        array_like=True,
        omit_defaults=True,
        gc=False,
    ):
        ts: float
        events: list[Any]

    class KVCacheEvent(
        msgspec.Struct,
        array_like=True,
        omit_defaults=True,
        gc=False,
        tag=True,
    ):
        """Base class for all KV cache-related events"""

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return SimpleNamespace(**locals())  # fmt: skip


V = _vllm_current()
L = _vllm_legacy()


def _encode(batch: Any) -> bytes:
    return msgspec.msgpack.Encoder().encode(batch)


def test_the_tags_are_the_class_names_as_msgspec_writes_them_for_tag_true() -> None:
    class BlockStored(msgspec.Struct, tag=True):
        x: int

    assert msgspec.msgpack.decode(_encode(BlockStored(1))) == {"type": "BlockStored", "x": 1}
    assert msgspec.msgpack.decode(_encode(V.BlockRemoved([1], "GPU"))) == {
        "type": "BlockRemoved",
        "block_hashes": [1],
        "medium": "GPU",
    }


def test_a_current_vllm_batch_with_bytes_hashes_decodes() -> None:
    h1, h2 = bytes(range(32)), bytes(range(1, 33))
    batch = V.KVEventBatch(
        ts=1.5,
        events=[
            V.AllBlocksCleared(),
            V.BlockStored([h1, h2], None, list(range(32)), 16, None, "GPU", None, [None, None], 0, "full_attention"),
            V.BlockRemoved([h1], "GPU", 0),
        ],
        data_parallel_rank=0,
    )
    assert decode_batch(_encode(batch)) == EventBatch(
        ts=1.5,
        events=(
            AllBlocksCleared(),
            BlockStored((h1, h2), None, tuple(range(32)), 16, None, "GPU", None, 0),
            BlockRemoved((h1,), "GPU", 0),
        ),
        data_parallel_rank=0,
    )


def test_int_hashes_up_to_64_bits_decode_as_ints() -> None:
    big = (1 << 64) - 1  # maybe_convert_block_hash keeps the low 64 bits: a msgpack uint64
    batch = V.KVEventBatch(ts=2.0, events=[V.BlockStored([big, 7], 5, [1] * 32, 16, None, "GPU", None)])
    (stored,) = decode_batch(_encode(batch)).events
    assert stored == BlockStored((big, 7), 5, tuple([1] * 32), 16, None, "GPU", None)


def test_a_legacy_positional_batch_decodes() -> None:
    batch = L.KVEventBatch(
        ts=3.0,
        events=[L.BlockStored([11, 12], 10, [0] * 32, 16, None), L.BlockRemoved([11]), L.AllBlocksCleared()],
    )
    assert msgspec.msgpack.decode(_encode(batch))[1][0][0] == "BlockStored"  # positional, tag first
    assert decode_batch(_encode(batch)).events == (
        BlockStored((11, 12), 10, (0,) * 32, 16),
        BlockRemoved((11,)),
        AllBlocksCleared(),
    )


def test_an_array_batch_of_map_events_as_vllm_0_26_sent_decodes() -> None:
    batch = V.MixedEventBatch(4.0, [V.BlockRemoved([b"\x01"], "CPU")], 1)
    assert decode_batch(_encode(batch)) == EventBatch(4.0, (BlockRemoved((b"\x01",), "CPU"),), 1)


def test_unknown_fields_and_unknown_event_kinds_are_ignored() -> None:
    raw = {
        "ts": 5.0,
        "events": [
            {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [2], "block_size": 1,
             "lora_id": None, "medium": "GPU", "lora_name": "adapter", "future_field": {"x": 1}},
            {"type": "BlockPinned", "block_hashes": [1]},
            ["BlockRemoved", [1], "GPU", 0, "a future positional field"],
        ],
        "another_future_field": True,
    }  # fmt: skip
    assert decode_batch(msgspec.msgpack.encode(raw)).events == (
        BlockStored((1,), None, (2,), 1, None, "GPU", "adapter"),
        BlockRemoved((1,), "GPU", 0),
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgspec.msgpack.encode("a string"),
        msgspec.msgpack.encode({"ts": "soon", "events": []}),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]]),
        msgspec.msgpack.encode(
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": None}]]
        ),
        msgspec.msgpack.encode([1.0, [42]]),
    ],
    ids=["not msgpack", "not a batch", "ts not a number", "a float hash", "no block size", "an event not tagged"],
)
def test_what_is_not_a_batch_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_batch(payload)


def test_sequence_frames_are_8_bytes_big_endian_and_the_end_marker_reads_minus_one() -> None:
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1  # vLLM's END_SEQ
    assert encode_seq(258) == b"\x00" * 6 + b"\x01\x02"
    with pytest.raises(KvEventDecodeError):
        decode_seq(b"\x00")
