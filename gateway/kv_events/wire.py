"""vLLM's KV-cache event batches on the wire, decoded into frozen values.

What vLLM sends (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):

* on the PUB socket, one multipart message per batch: ``[topic, seq, payload]``; ``seq`` is the
  batch's number as 8 bytes big-endian (from 0 at the engine's start, +1 per batch), ``payload``
  the ``KVEventBatch`` as msgpack (``msgspec.msgpack.Encoder``);
* on the replay ROUTER, asked ``[b"", start_seq]`` (8 bytes big-endian) by a DEALER, every
  buffered batch from ``start_seq`` on as ``[b"", seq, payload]``, then ``[b"", -1, b""]``
  (``END_SEQ``: -1 as 8 signed bytes).

The payload's shape changed over vLLM's releases, and a gateway meets them all:

* **legacy, positional** (to vLLM PR #42892): the batch ``[ts, events, dp_rank?]`` and each event
  a tagged array ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, ...]`` (``array_like=True``, ``tag=True``;
  ``omit_defaults`` drops trailing fields left at their defaults, and older engines simply stop
  earlier: the fields were only ever appended);
* **events as maps** (from #42892, e.g. vLLM 0.26): the batch still an array, each event a map
  ``{"type": "BlockStored", "block_hashes": ..., ...}`` (msgspec's default tag field ``type``);
* **all maps** (later main): the batch a map ``{"ts", "events", "data_parallel_rank"}`` too.

Decoding reads msgpack generically and picks fields by position or name, so unknown fields
(``extra_keys``, ``kv_cache_spec_kind``, whatever comes next) are ignored and unknown event
kinds skipped. Block hashes are ``bytes`` (vLLM's default ``ExternalBlockHash``) or 64-bit
``int`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the low 64 bits of the hash, big-endian);
they are kept as sent, since the same engine always sends the same kind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

BlockHash = int | bytes
"""vLLM's ``ExternalBlockHash``: bytes by default, an int when the engine is told to."""

END_SEQ = -1
"""The sequence number closing a replay (sent with an empty payload)."""

TAG_FIELD = "type"
"""The field holding an event's kind in the map layout (msgspec's default ``tag_field``)."""


class KvEventDecodeError(ValueError):
    """A frame or payload that is not a vLLM KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks the engine computed and now holds, in chain order; ``parent_block_hash`` is the
    block before the first (None at a prompt's start, or when the engine does not say)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted (from ``medium``: GPU unless it says otherwise)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (a reset, or a fresh engine)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: the events of one engine step, in the order they happened."""

    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None


# Positional field names after the tag, in vLLM's declaration order (only ever appended to).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_STORED_TAIL = ("extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_BATCH_FIELDS = ("ts", "events", "data_parallel_rank")

_decoder = msgspec.msgpack.Decoder()


def decode_seq(frame: bytes) -> int:
    """A sequence frame: 8 bytes big-endian, signed so that ``END_SEQ`` reads as -1."""
    if len(frame) != 8:
        raise KvEventDecodeError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """A sequence frame as vLLM writes it (and the start of a replay request)."""
    return seq.to_bytes(8, "big", signed=True)


def decode_batch(payload: bytes) -> EventBatch:
    """A payload in any of vLLM's layouts; raises ``KvEventDecodeError`` on anything else."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventDecodeError(f"not msgpack: {exc}") from exc
    fields = _named(raw, _BATCH_FIELDS, "batch")
    ts, events = fields.get("ts"), fields.get("events")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise KvEventDecodeError("a batch needs a number ts and a list of events")
    decoded = tuple(event for event in map(_event, events) if event is not None)
    return EventBatch(float(ts), decoded, _opt_int(fields.get("data_parallel_rank"), "data_parallel_rank"))


def _named(raw: Any, names: Sequence[str], what: str) -> Mapping[str, Any]:
    """Fields by name, from a map (extra keys ignored) or a positional array (extra tail ignored)."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, list):
        return dict(zip(names, raw, strict=False))
    raise KvEventDecodeError(f"a {what} is an array or a map, got {type(raw).__name__}")


def _event(raw: Any) -> KvEvent | None:
    """One event, or None for a kind this gateway does not know (a newer engine's)."""
    body: Any
    if isinstance(raw, list) and raw:
        tag, body = raw[0], raw[1:]
    elif isinstance(raw, dict):
        tag, body = raw.get(TAG_FIELD), raw
    else:
        raise KvEventDecodeError(f"an event is a tagged array or map, got {raw!r:.80}")
    if tag == "BlockStored":
        return _stored(_named(body, (*_STORED_FIELDS, *_STORED_TAIL), "BlockStored"))
    if tag == "BlockRemoved":
        f = _named(body, _REMOVED_FIELDS, "BlockRemoved")
        return BlockRemoved(_hashes(f.get("block_hashes")), _opt_str(f.get("medium")), _opt_int(f.get("group_idx")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if isinstance(tag, str):
        return None
    raise KvEventDecodeError(f"an event's tag is a string, got {tag!r:.80}")


def _stored(f: Mapping[str, Any]) -> BlockStored:
    tokens, size = f.get("token_ids", []), f.get("block_size")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise KvEventDecodeError("BlockStored.token_ids is a list of ints")
    if not isinstance(size, int) or isinstance(size, bool):
        raise KvEventDecodeError("BlockStored.block_size is an int")
    return BlockStored(
        block_hashes=_hashes(f.get("block_hashes")),
        parent_block_hash=_hash_or_none(f.get("parent_block_hash")),
        token_ids=tuple(tokens),
        block_size=size,
        lora_id=_opt_int(f.get("lora_id")),
        medium=_opt_str(f.get("medium")),
        lora_name=_opt_str(f.get("lora_name")),
        group_idx=_opt_int(f.get("group_idx")),
    )


def _hashes(raw: Any) -> tuple[BlockHash, ...]:
    if not isinstance(raw, list):
        raise KvEventDecodeError("block_hashes is a list")
    return tuple(map(_hash, raw))


def _hash(raw: Any) -> BlockHash:
    if isinstance(raw, bytes) or (isinstance(raw, int) and not isinstance(raw, bool)):
        return raw
    raise KvEventDecodeError(f"a block hash is bytes or an int, got {type(raw).__name__}")


def _hash_or_none(raw: Any) -> BlockHash | None:
    return None if raw is None else _hash(raw)


def _opt_int(raw: Any, what: str = "field") -> int | None:
    if raw is None or (isinstance(raw, int) and not isinstance(raw, bool)):
        return raw
    raise KvEventDecodeError(f"{what} is an int or nil, got {type(raw).__name__}")


def _opt_str(raw: Any) -> str | None:
    return raw if raw is None or isinstance(raw, str) else None
