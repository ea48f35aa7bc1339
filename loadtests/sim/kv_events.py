"""The simulator's KV-cache events, byte for byte as vLLM publishes them (``sim --kv-events``).

What a vLLM engine started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", ...}'`` sends, after ``vllm/distributed/kv_events.py`` (vLLM main at commit
0181ea3173e53eea8cf04a86891488e3dc89bb34: the batch and its events as msgpack *maps*, vLLM PR
#42892 and after):

* a PUB socket: one ``[topic, seq, payload]`` per engine step that changed the cache, ``seq``
  8 bytes big-endian from 0, ``payload`` a ``KVEventBatch`` encoded by ``msgspec.msgpack``;
* a ROUTER replay socket: ``[b"", start_seq]`` asks for every buffered batch from ``start_seq``,
  answered ``[b"", seq, payload]`` each, then ``[b"", -1, b""]``.

The structs below mirror vLLM's class definitions (same fields in the same order, the same tag
names and struct options), so the bytes are what vLLM's own encoder writes. The hashes are the
cache's keys (``KVCache.hashing``) as ``BlockHashing.external`` gives them:

* by default the simulator's own (``kvcache.chain_hashes`` from ``salt_root(cache_salt)``,
  64-bit ints, as vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), not vLLM's: a consumer
  that computes hashes must compute the simulator's to match;
* with ``sim --tokenizer``, vLLM's own block hashes of vLLM's token ids (``VllmHashing``): the
  digest as bytes (vLLM's default ``ExternalBlockHash``), or its low 64 bits as an int with
  ``--int-block-hashes`` (vLLM's ``maybe_convert_block_hash``, converted only here, on the way
  out, as vLLM does: the cache and the chain keep the digests).

One batch per engine step: the events of one synchronous step of the simulator's loop are
gathered and sent together when the loop next runs (``call_soon``). A fresh engine starts with
``AllBlocksCleared`` (what a consumer needs to know after a restart). Evictions are
``BlockRemoved``. Stored runs carry a parent link and token ids only when the scheduler gives
them (``KVCache.commit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from loadtests.sim.kvcache import BlockHash, KVCache, SimHashing

log = logging.getLogger("loadtests.sim.kv_events")

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
BUFFER_STEPS = 10_000  # vLLM's default replay buffer


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; ``tag=True`` writes the class name under ``type``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
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
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def offset_endpoint(endpoint: str, index: int) -> str:
    """Engine ``index``'s endpoint: the port plus ``index`` (vLLM's rule for data-parallel ranks)."""
    if index == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{index}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + index}"


class KvEventPublisher:
    """One engine's publisher (a ``KVCacheObserver``): PUB and replay ROUTER, both bound here.

    Unlike vLLM (which binds only wildcard addresses and connects to others), the simulator
    always binds: it is the stable side the gateway connects to."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        *,
        block_size: int,
        topic: str = "",
        rank: int = 0,
        external: Callable[[BlockHash], BlockHash] | None = None,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._block_size = block_size
        self._external = external or SimHashing(block_size).external  # the hash as events carry it
        self._rank = rank
        self._seq = 0
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._flush_handle: asyncio.Handle | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        self._encoder = msgspec.msgpack.Encoder()

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]) -> None:
        block_hash = self._external(block_hash)
        parent = None if parent is None else self._external(parent)
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            event = BlockStored([block_hash], parent, list(token_ids), self._block_size, None, MEDIUM_GPU, None)
            self._add(event)

    def removed(self, block_hash: BlockHash) -> None:
        block_hash = self._external(block_hash)
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._add(BlockRemoved([block_hash], MEDIUM_GPU))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def _add(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        self._pending.append(event)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what the last step gathered as one batch."""
        self._flush_handle = None
        if not self._pending:
            return
        batch = KVEventBatch(ts=time.time(), events=self._pending, data_parallel_rank=self._rank)
        self._pending = []
        payload = self._encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        with contextlib.suppress(zmq.Again):  # a PUB never blocks; past its high-water mark it drops
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (vLLM's ``_service_replay``)."""
        if self._replay is None:
            return
        while True:
            frame = await self._replay.recv_multipart()
            if len(frame) != 3:
                log.warning("invalid replay request: %s", frame)
                continue
            client, _, start = frame
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self._ctx.destroy(linger=0)


def attach_publishers(
    caches: Sequence[KVCache], endpoint: str, replay_endpoint: str | None, *, topic: str = ""
) -> list[KvEventPublisher]:
    """One publisher per engine's cache (engine ``i`` on the endpoints' ports + ``i``), each
    starting with ``AllBlocksCleared``; call from the running loop."""
    publishers = []
    for i, kv in enumerate(caches):
        replay = None if replay_endpoint is None else offset_endpoint(replay_endpoint, i)
        publisher = KvEventPublisher(
            offset_endpoint(endpoint, i), replay, block_size=kv.block_size, topic=topic, external=kv.hashing.external
        )
        kv.observe(publisher)
        publisher.cleared()
        publishers.append(publisher)
    return publishers
