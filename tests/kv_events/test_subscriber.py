"""A backend's KV-event feed over real ZeroMQ sockets on loopback: in order, gaps replayed, and
not live (then live again) when a replay fails or the engine falls silent.

The engine side is vLLM's protocol by hand (``ZmqEventPublisher``): an XPUB (a PUB that also
says when a subscriber has joined, so no batch is sent before anyone listens) and a ROUTER
answering ``[id, b"", start]`` with ``[id, b"", seq, payload]`` and ``[id, b"", -1, b""]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.kv_events.block_index import KvBlockIndexes
from gateway.kv_events.subscriber import KvEventSubscriber, KvFeed, LostReason
from gateway.kv_events.wire import AllBlocksCleared, BlockStored, EventBatch

BACKEND = "engine-a"


def _payload(*hashes: int) -> bytes:
    event = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None, "token_ids": [],
             "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip
    return msgspec.msgpack.encode({"ts": 1.0, "events": [event]})


@dataclass
class Recorder:
    """Sink and observer at once: every batch and every transition, in order."""

    batches: list[EventBatch] = field(default_factory=list)
    states: list[str] = field(default_factory=list)
    index: KvBlockIndexes = field(default_factory=KvBlockIndexes)

    def apply(self, backend: str, batch: EventBatch) -> None:
        assert backend == BACKEND
        self.batches.append(batch)
        self.index.apply(backend, batch)

    def on_live(self, backend: str) -> None:
        self.states.append("live")

    def on_lost(self, backend: str, reason: LostReason) -> None:
        self.states.append(f"lost:{reason.value}")

    def stored(self) -> list[int | bytes]:
        return [h for b in self.batches for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes]


class Engine:
    """vLLM's publisher side; ``answer_replays`` off makes its ROUTER ignore requests."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.router = ctx.socket(zmq.ROUTER)
        self.endpoint = _bind(self.pub)
        self.replay_endpoint = _bind(self.router)
        self.buffer: dict[int, bytes] = {}
        self.answer_replays = True
        self.replay_requests: list[int] = []
        self.successors: list[Engine] = []

    def close(self) -> None:
        """Its sockets, and those of the engines that took its place (``restart``), closed."""
        for engine in (self, *self.successors):
            engine.pub.close(linger=0)
            engine.router.close(linger=0)

    async def restart(self, ctx: zmq.asyncio.Context, *, keep_buffer: bool = False) -> Engine:
        """This engine's sockets closed and bound again on the same endpoints by a new ``Engine``
        (a fresh process: an empty replay buffer, unless ``keep_buffer``). ZeroMQ releases a port
        in its I/O thread after ``close``: the bind is tried again until it succeeds (5 s at most)."""
        self.pub.close(linger=0)
        self.router.close(linger=0)
        fresh = Engine.__new__(Engine)
        fresh.pub, fresh.router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
        fresh.endpoint, fresh.replay_endpoint = self.endpoint, self.replay_endpoint
        await until(lambda: _rebound(fresh.pub, self.endpoint), "the engine's port free again")
        await until(lambda: _rebound(fresh.router, self.replay_endpoint), "the replay port free again")
        fresh.buffer = dict(self.buffer) if keep_buffer else {}
        fresh.answer_replays, fresh.replay_requests, fresh.successors = True, [], []
        self.successors.append(fresh)
        return fresh

    async def joined(self) -> None:
        assert (await asyncio.wait_for(self.pub.recv(), 5))[0] == 1  # a subscription message

    async def publish(self, seq: int, payload: bytes, *, drop: bool = False) -> None:
        self.buffer[seq] = payload
        if not drop:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    async def serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replay_requests.append(int.from_bytes(start, "big"))
            if not self.answer_replays:
                continue
            for seq in sorted(s for s in self.buffer if s >= int.from_bytes(start, "big")):
                await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            await self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])


def _rebound(sock: zmq.asyncio.Socket, endpoint: str) -> bool:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EADDRINUSE:
            raise
        return False
    return True


def _bind(sock: zmq.asyncio.Socket) -> str:
    sock.bind("tcp://127.0.0.1:0")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


async def until(cond: Callable[[], bool], what: str, deadline_s: float = 5.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def _start(ctx: zmq.asyncio.Context, **feed: float) -> tuple[Engine, Recorder, list[asyncio.Task[None]]]:
    engine, rec = Engine(ctx), Recorder()
    config = KvFeed(endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint, topic="kv", **feed)
    sub = KvEventSubscriber(BACKEND, config, sink=rec, observer=rec, context=ctx)
    tasks = [asyncio.create_task(sub.run()), asyncio.create_task(engine.serve_replays())]
    await engine.joined()
    return engine, rec, tasks


async def _stop(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_batches_in_sequence_are_applied_in_order_and_the_feed_is_live(ctx: zmq.asyncio.Context) -> None:
    engine, rec, tasks = await _start(ctx)
    try:
        for seq in range(3):
            await engine.publish(seq, _payload(100 + seq))
        await until(lambda: len(rec.batches) == 3, "three batches")
        assert rec.stored() == [100, 101, 102]
        assert rec.states == ["live"]
        assert rec.index.match(BACKEND, [100, 101, 102, 103]) == 3
        assert engine.replay_requests == []
    finally:
        await _stop(tasks)


async def test_a_gap_is_replayed_from_the_next_expected_batch(ctx: zmq.asyncio.Context) -> None:
    engine, rec, tasks = await _start(ctx)
    try:
        await engine.publish(0, _payload(1))
        await engine.publish(1, _payload(2), drop=True)
        await engine.publish(2, _payload(3), drop=True)
        await engine.publish(3, _payload(4))
        await engine.publish(4, _payload(5))
        await until(lambda: len(rec.batches) == 5, "five batches")
        assert rec.stored() == [1, 2, 3, 4, 5]
        assert engine.replay_requests == [1]
        assert rec.states == ["live"]
    finally:
        await _stop(tasks)


async def test_a_late_subscriber_replays_the_history_from_the_first_batch(ctx: zmq.asyncio.Context) -> None:
    engine, rec, tasks = await _start(ctx)
    try:
        await engine.publish(0, _payload(7), drop=True)
        await engine.publish(1, _payload(8))
        await until(lambda: rec.states == ["live"], "live after the replay")
        assert (engine.replay_requests, rec.stored()) == ([0], [7, 8])
    finally:
        await _stop(tasks)


async def test_a_replay_that_gets_no_answer_loses_the_feed_until_the_next_batch_in_sequence(
    ctx: zmq.asyncio.Context,
) -> None:
    engine, rec, tasks = await _start(ctx, replay_timeout_s=0.2)
    try:
        await engine.publish(0, _payload(1))
        await until(lambda: rec.states == ["live"], "live")
        engine.answer_replays = False
        await engine.publish(1, _payload(2), drop=True)
        await engine.publish(2, _payload(3))
        await until(lambda: rec.states == ["live", "lost:gap_unreplayed"], "the feed lost")
        await until(lambda: len(rec.batches) == 3, "the index reset, then batch 2")
        assert rec.batches[1].events == (AllBlocksCleared(),)  # what was missed may have removed block 1
        assert rec.index.match(BACKEND, [1]) == 0
        assert rec.index.match(BACKEND, [3]) == 1
        await engine.publish(3, _payload(4))
        await until(lambda: rec.states[-1] == "live", "live again")
        assert rec.states == ["live", "lost:gap_unreplayed", "live"]
    finally:
        await _stop(tasks)


async def test_silence_past_the_bound_loses_the_feed_and_the_next_batch_brings_it_back(
    ctx: zmq.asyncio.Context,
) -> None:
    engine, rec, tasks = await _start(ctx, silence_s=0.2)
    try:
        await engine.publish(0, _payload(1))
        await until(lambda: rec.states == ["live", "lost:silent"], "silence noticed")
        await engine.publish(1, _payload(2))
        await until(lambda: rec.states == ["live", "lost:silent", "live"], "live again")
        assert rec.stored() == [1, 2]
        assert engine.replay_requests == []
    finally:
        await _stop(tasks)


async def test_a_batch_that_does_not_decode_loses_the_feed(ctx: zmq.asyncio.Context) -> None:
    engine, rec, tasks = await _start(ctx)
    try:
        await engine.publish(0, _payload(1))
        await engine.publish(1, b"\xc1not msgpack")
        await until(lambda: rec.states == ["live", "lost:decode_error"], "the feed lost")
        await engine.publish(2, _payload(3))
        await until(lambda: rec.states[-1] == "live", "live again")
        assert rec.index.match(BACKEND, [1]) == 0
        assert rec.index.match(BACKEND, [3]) == 1
    finally:
        await _stop(tasks)


async def test_an_engine_that_restarts_counting_from_zero_empties_the_index(ctx: zmq.asyncio.Context) -> None:
    engine, rec, tasks = await _start(ctx)
    try:
        await engine.publish(0, _payload(1))
        await engine.publish(1, _payload(2))
        await until(lambda: len(rec.batches) == 2, "two batches")
        engine.buffer.clear()
        await engine.publish(0, _payload(9))
        await until(lambda: rec.index.match(BACKEND, [9]) == 1, "the restarted engine's block")
        assert rec.index.match(BACKEND, [1]) == 0
        assert rec.states == ["live"]
    finally:
        await _stop(tasks)


async def test_a_restarted_engine_whose_first_batch_went_out_before_the_reconnect_empties_the_index(
    ctx: zmq.asyncio.Context,
) -> None:
    """The fresh engine's first batch is missed (the SUB was still reconnecting) and it publishes
    nothing more: the reconnection alone, and its replay socket holding nothing that far, empty
    the index."""
    engine, rec, tasks = await _start(ctx)
    try:
        for seq in range(3):
            await engine.publish(seq, _payload(seq + 1))
        await until(lambda: rec.index.match(BACKEND, [1, 2, 3]) == 3, "three blocks held")
        fresh = await engine.restart(ctx)
        tasks.append(asyncio.create_task(fresh.serve_replays()))
        await fresh.publish(0, _payload(9), drop=True)  # out before the subscriber is back
        await until(lambda: rec.index.match(BACKEND, [1]) == 0, "the old engine's blocks forgotten")
        assert 2 in fresh.replay_requests, "it asked the new engine for the last batch it had applied"
        await fresh.publish(1, _payload(10))  # the new engine's next batch: replayed from its start
        await until(lambda: rec.index.match(BACKEND, [10]) == 1, "the new engine's blocks")
        assert rec.index.match(BACKEND, [9]) == 1
    finally:
        await _stop(tasks)
        engine.close()


async def test_a_reconnection_to_the_same_engine_keeps_the_index(ctx: zmq.asyncio.Context) -> None:
    engine, rec, tasks = await _start(ctx)
    try:
        for seq in range(3):
            await engine.publish(seq, _payload(seq + 1))
        await until(lambda: rec.index.match(BACKEND, [1, 2, 3]) == 3, "three blocks held")
        same = await engine.restart(ctx, keep_buffer=True)  # the same engine behind a dropped connection
        tasks.append(asyncio.create_task(same.serve_replays()))
        await until(lambda: 2 in same.replay_requests, "the check on reconnection")
        await same.publish(3, _payload(4))
        await until(lambda: rec.index.match(BACKEND, [1, 2, 3, 4]) == 4, "a fourth block on the three kept")
    finally:
        await _stop(tasks)
        engine.close()
