"""One backend's KV-event feed: a ZeroMQ SUB on the engine's publisher, in sequence or not live.

The engine numbers its batches (``wire.py``). The subscriber applies them in that order to a
``KvEventSink`` and says whether the sink's picture can be trusted (``KvFeedObserver``):

* **in sequence**: the batch is applied; a feed that was not live is live again
  (``on_live``).
* **a gap** (a batch numbered past the next one: the SUB socket dropped some, or the subscriber
  joined late): the missing batches are asked of the engine's replay socket (a DEALER to its
  ROUTER, from the next expected number) and applied first. Joining, the next expected number is
  0, so a late subscriber replays the engine's buffered history.
* **a replay that fails** (no replay endpoint, no answer within ``replay_timeout_s``, or the
  engine's buffer no longer holds the start): ``on_lost(backend, "gap_unreplayed")``. Events
  are missing, so the index is emptied (a synthetic ``AllBlocksCleared``), the batch applied,
  and the feed is live again at the next batch in sequence: from then on the index holds a
  subset of what the engine holds, never a block it may have dropped.
* **a payload that does not decode**: ``on_lost(backend, "decode_error")``, handled as a gap
  that cannot be replayed (the replay would send the same bytes).
* **silence** longer than ``silence_s`` while live: ``on_lost(backend, "silent")``; the next
  batch in sequence makes it live again. vLLM publishes only when blocks change, so an idle
  engine is silent too: the bound is the longest the gateway trusts an index it hears nothing
  about.
* **a number below the next expected one** (not a batch a replay already gave): the engine
  restarted and counts from 0 again; the index is emptied and the batch taken as the new start.
* **the SUB reconnected** (ZeroMQ reconnects by itself; its socket monitor says when): the engine
  may be a new one whose first batch (``AllBlocksCleared``) went out before the SUB was back, and
  which publishes nothing more until its first request. Its replay socket is asked for the last
  batch applied: the same engine still buffers it and answers with it; a new one, counting from
  0 again, has nothing that far and answers with the end of the replay at once. Then the index is
  emptied there and then, before any request can be routed to the cold engine on it. (A new
  engine that already published as many batches as the old one had is told apart by the next
  rule only when its numbers fall behind; no answer, or no replay socket, proves nothing.)

Consumers route on the index only while the feed is live, and on the gateway's own estimate
otherwise. The observer hears transitions only (a lost feed is not reported twice).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio

from .wire import END_SEQ, AllBlocksCleared, EventBatch, KvEventDecodeError, decode_batch, decode_seq, encode_seq

log = logging.getLogger("gateway.kv_events")


class LostReason(enum.StrEnum):
    """Why a feed stopped being live (a metric label)."""

    GAP_UNREPLAYED = "gap_unreplayed"
    SILENT = "silent"
    DECODE_ERROR = "decode_error"


class KvEventSink(Protocol):
    """Where a backend's batches go, in the engine's order (e.g. ``KvBlockIndexes``)."""

    def apply(self, backend: str, batch: EventBatch) -> None: ...


class KvFeedObserver(Protocol):
    """Told when a backend's feed can be trusted again, and when it cannot any more."""

    def on_live(self, backend: str) -> None: ...

    def on_lost(self, backend: str, reason: LostReason) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class KvFeed:
    """Where and how to listen to one engine's events.

    ``KvFeed(endpoint="tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558", topic="kv")``:
    ``endpoint`` is the engine's PUB, ``replay_endpoint`` its ROUTER (None: gaps cannot be
    replayed), ``topic`` the engine's ``--kv-events-config`` topic ("" takes every message).
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    silence_s: float = 30.0
    replay_timeout_s: float = 2.0


_CLEARED = (AllBlocksCleared(),)


class KvEventSubscriber:
    """The feed of one backend; ``run()`` until cancelled."""

    def __init__(
        self,
        backend: str,
        feed: KvFeed,
        *,
        sink: KvEventSink,
        observer: KvFeedObserver,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.backend = backend
        self.feed = feed
        self._sink = sink
        self._observer = observer
        self._ctx = context or zmq.asyncio.Context.instance()
        self._topic = feed.topic.encode()
        self._expected = 0  # the next batch's number
        self._replayed_through = -1  # batches the SUB may still deliver after a replay gave them
        self._live = False

    @property
    def live(self) -> bool:
        return self._live

    async def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(self.feed.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        silence_ms = max(1, int(self.feed.silence_s * 1000))
        connections = 0
        try:
            while True:
                ready = dict(await poller.poll(timeout=silence_ms))
                if not ready:
                    self._lose(LostReason.SILENT)
                    continue
                if monitor in ready:
                    await monitor.recv_multipart()  # only EVENT_CONNECTED is asked for
                    connections += 1
                    if connections > 1:
                        await self._check_same_engine()
                if sub in ready:
                    frames = await sub.recv_multipart()
                    await self._on_message(frames)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _check_same_engine(self) -> None:
        """The SUB reconnected: empty the index if the engine is a new one (module docstring)."""
        last = self._expected - 1
        if last < 0 or self.feed.replay_endpoint is None:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.feed.replay_endpoint)
        try:
            await dealer.send_multipart([b"", encode_seq(last)])
            if not await dealer.poll(timeout=max(1, int(self.feed.replay_timeout_s * 1000))):
                return
            frames = await dealer.recv_multipart()
        finally:
            dealer.close(linger=0)
        restarted = False
        with contextlib.suppress(KvEventDecodeError):
            restarted = len(frames) == 3 and decode_seq(frames[1]) == END_SEQ
        if restarted:
            log.info("kv events of %s: the engine restarted (reconnected; it has no batch %d)", self.backend, last)
            self._reset(0)

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or (self._topic and frames[0] != self._topic):
            return  # another publisher's message on a shared prefix
        try:
            seq = decode_seq(frames[1])
        except KvEventDecodeError:
            self._lose(LostReason.DECODE_ERROR)
            return
        if await self._receive(seq, frames[2]):
            self._become_live()

    async def _receive(self, seq: int, payload: bytes) -> bool:
        """Apply batch ``seq`` after whatever is missing before it; True if nothing was missed."""
        if seq <= self._replayed_through:
            return True  # the replay already applied it
        self._replayed_through = -1
        if seq < self._expected:
            log.info("kv events of %s: the engine restarted (batch %d after %d)", self.backend, seq, self._expected - 1)
            self._reset(0)
        complete = seq == self._expected or await self._replay(self._expected, seq)
        if seq < self._expected:
            return True  # the replay gave it (and what follows it is checked in turn)
        if not complete:
            self._lose(LostReason.GAP_UNREPLAYED)
            self._reset(seq)
        try:
            batch = decode_batch(payload)
        except KvEventDecodeError as exc:
            log.warning("kv events of %s: batch %d does not decode: %s", self.backend, seq, exc)
            self._lose(LostReason.DECODE_ERROR)
            self._reset(seq + 1)
            return False
        self._sink.apply(self.backend, batch)
        self._expected = seq + 1
        return complete

    async def _replay(self, start: int, stop: int) -> bool:
        """Ask the engine for batches ``start``.. and apply them; True if all up to ``stop`` came."""
        if self.feed.replay_endpoint is None:
            return False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.feed.replay_endpoint)
        timeout_ms = max(1, int(self.feed.replay_timeout_s * 1000))
        try:
            await dealer.send_multipart([b"", encode_seq(start)])
            while await dealer.poll(timeout=timeout_ms):
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    return False
                seq = decode_seq(frames[1])
                if seq == END_SEQ:
                    return self._expected >= stop
                if seq < self._expected:
                    continue
                if seq > self._expected:
                    return False  # the engine's buffer starts past what is missing
                self._sink.apply(self.backend, decode_batch(frames[2]))
                self._expected, self._replayed_through = seq + 1, seq
            return False
        except KvEventDecodeError:
            return False
        finally:
            dealer.close(linger=0)

    def _reset(self, expected: int) -> None:
        """Forget everything the index holds; the next batch expected is ``expected``."""
        self._sink.apply(self.backend, EventBatch(time.time(), _CLEARED))
        self._expected = expected
        self._replayed_through = -1

    def _become_live(self) -> None:
        if not self._live:
            self._live = True
            log.info("kv events of %s: live", self.backend)
            self._observer.on_live(self.backend)

    def _lose(self, reason: LostReason) -> None:
        if self._live:
            self._live = False
            log.warning("kv events of %s: not live (%s); routing on the estimate", self.backend, reason.value)
            self._observer.on_lost(self.backend, reason)
