"""The engines' KV-event feeds of the policy in force: one subscriber per backend with ``kv_events``.

``KvFeeds`` turns the policy's ``kv_events`` (``gateway/policy/model.py``, ``KvEvents``) into
running ``KvEventSubscriber``s (``gateway/kv_events/subscriber.py``) that feed one exact
``KvBlockIndexes``, and says how each feed is doing: metrics (``gateway_kv_events_*``) and a
status per backend for ``/admin/backends``. The prefix router reads the index through
``gateway/routing/engine_view.py`` while ``live(backend)`` says so.

Lifecycle, driven by the composition root (``gateway/service.py``):

* ``adopt(backends)`` at construction and at every reload: a backend whose ``kv_events`` is new
  or changed gets a fresh subscriber (and an empty index: another endpoint is another engine's
  truth); one whose ``kv_events`` is gone, or that left the policy, has its subscriber cancelled,
  its index and its metric series dropped; a backend whose ``kv_events`` did not change keeps its
  subscriber running, its index and its state untouched. Before ``start`` it only records the
  plan (a reload can come before the event loop runs the gateway).
* ``start()`` in the running loop, ``aclose()`` at shutdown: every subscriber cancelled and
  awaited, then the ZeroMQ context closed.

The subscriber logs each transition itself (a WARNING naming the backend and the reason when a
feed is lost, an INFO when it is live again); ``FeedMetrics``, its observer here, counts them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import zmq.asyncio

from gateway.kv_events.block_index import KvBlockIndexes
from gateway.kv_events.subscriber import KvEventSubscriber, KvFeed, LostReason
from gateway.kv_events.wire import EventBatch
from gateway.policy.model import Backend, KvEvents
from gateway.shared.loops import stop_loops
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


def feed_of(events: KvEvents) -> KvFeed:
    """The subscriber's settings from the policy's (the replay timeout keeps its default)."""
    return KvFeed(
        endpoint=events.endpoint,
        replay_endpoint=events.replay_endpoint,
        topic=events.topic,
        silence_s=events.silence_s,
    )


class FeedMetrics:
    """The feeds' sink and observer: batches go to the index, counts and states to the metrics.

    ``gateway_kv_events_blocks`` is read from the index at scrape time (``set_function``), so the
    batch path pays one counter increment and nothing else."""

    def __init__(self, metrics: Metrics, indexes: KvBlockIndexes) -> None:
        self._metrics = metrics
        self._indexes = indexes

    def apply(self, backend: str, batch: EventBatch) -> None:
        self._indexes.apply(backend, batch)
        self._metrics.child(self._metrics.kv_events_batches, backend).inc()

    def on_live(self, backend: str) -> None:
        self._metrics.child(self._metrics.kv_events_feed_live, backend).set(1)

    def on_stopped(self, backend: str) -> None:
        """The feed's task ended on an error: not live, whatever its last state said."""
        self._metrics.child(self._metrics.kv_events_feed_live, backend).set(0)

    def on_lost(self, backend: str, reason: LostReason) -> None:
        self._metrics.child(self._metrics.kv_events_feed_live, backend).set(0)
        self._metrics.child(self._metrics.kv_events_feed_lost, backend, reason.value).inc()

    def track(self, backend: str) -> None:
        """A new feed: not live until its first batch in sequence, its index's size on scrape."""
        self._metrics.child(self._metrics.kv_events_feed_live, backend).set(0)
        index = self._indexes.index(backend)
        self._metrics.child(self._metrics.kv_events_blocks, backend).set_function(lambda: float(len(index)))
        self._metrics.child(self._metrics.kv_events_batches, backend)  # exported at 0 from now on

    def untrack(self, backend: str) -> None:
        """A feed gone: its index and every series it had."""
        self._indexes.forget(backend)
        m = self._metrics
        for metric in (m.kv_events_feed_live, m.kv_events_blocks, m.kv_events_batches):
            m.remove_child(metric, backend)
        for reason in LostReason:
            m.remove_child(m.kv_events_feed_lost, backend, reason.value)


@dataclass(slots=True)
class _Running:
    settings: KvEvents
    subscriber: KvEventSubscriber
    task: asyncio.Task[None] | None = None


class KvFeeds:
    """Every backend's KV-event subscriber, per the policy in force (see the module docstring)."""

    def __init__(self, metrics: Metrics, *, indexes: KvBlockIndexes | None = None) -> None:
        self.indexes = indexes or KvBlockIndexes()
        self._sink = FeedMetrics(metrics, self.indexes)
        self._feeds: dict[str, _Running] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._ctx: zmq.asyncio.Context | None = None
        self._started = False

    def adopt(self, backends: Iterable[Backend]) -> None:
        """Bring the feeds in line with ``backends`` (the policy's); unchanged feeds keep running."""
        wanted = {b.name: b.kv_events for b in backends if b.kv_events is not None}
        for name in [n for n, feed in self._feeds.items() if wanted.get(n) != feed.settings]:
            self._stop(name)
        for name, settings in wanted.items():
            if name not in self._feeds:
                self._add(name, settings)

    def start(self) -> None:
        """Run every planned feed; call in the event loop the gateway runs in."""
        self._started = True
        for name, feed in self._feeds.items():
            self._run(name, feed)

    async def aclose(self) -> None:
        tasks = [f.task for f in self._feeds.values() if f.task is not None]
        left = await stop_loops({*tasks, *self._stopping})
        if left:
            log.error("shutdown: kv-event feed(s) still running: %s", [t.get_name() for t in left])
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def status(self, backend: str) -> dict[str, object] | None:
        """The backend's feed for ``/admin/backends``; None when it has none."""
        feed = self._feeds.get(backend)
        if feed is None:
            return None
        return {
            "endpoint": feed.settings.endpoint,
            "replay_endpoint": feed.settings.replay_endpoint,
            "live": feed.subscriber.live,
            "blocks": len(self.indexes.index(backend)),
        }

    def clear(self, backend: str) -> None:
        """The backend went down or restarted (``BackendPool``'s health checks and scrapes): its engine
        may hold nothing of what its index says, and a restarted engine announces only what it
        stores from then on. Emptied, the index under-reports until the engine stores again, never
        claims a block the engine may have lost (the same rule as a gap that cannot be replayed)."""
        if backend in self._feeds:
            self.indexes.index(backend).clear()

    def live(self, backend: str) -> bool:
        """Whether ``backend``'s index may be routed on now: its feed runs and is in sequence."""
        feed = self._feeds.get(backend)
        return feed is not None and feed.task is not None and not feed.task.done() and feed.subscriber.live

    def subscribers(self) -> dict[str, KvEventSubscriber]:
        """The subscriber of each backend with a feed (a copy)."""
        return {name: feed.subscriber for name, feed in self._feeds.items()}

    def running(self) -> set[str]:
        """Backends whose subscriber's task runs (neither finished nor being cancelled)."""
        tasks = {name: feed.task for name, feed in self._feeds.items()}
        return {name for name, task in tasks.items() if task is not None and not task.done() and not task.cancelling()}

    def _add(self, name: str, settings: KvEvents) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        subscriber = KvEventSubscriber(name, feed_of(settings), sink=self._sink, observer=self._sink, context=self._ctx)
        feed = self._feeds[name] = _Running(settings, subscriber)
        self._sink.track(name)
        if self._started:
            self._run(name, feed)

    def _run(self, name: str, feed: _Running) -> None:
        feed.task = asyncio.get_running_loop().create_task(feed.subscriber.run(), name=f"kv-events-{name}")
        feed.task.add_done_callback(lambda task: self._feed_done(name, task))

    def _stop(self, name: str) -> None:
        feed = self._feeds.pop(name)
        if feed.task is not None:
            feed.task.cancel()
            self._stopping.add(feed.task)  # owned until it has closed its socket
            feed.task.add_done_callback(self._stopping.discard)
        self._sink.untrack(name)
        log.info("kv events of %s: feed stopped (policy)", name)

    def _feed_done(self, name: str, task: asyncio.Task[None]) -> None:
        """A feed that dies must say so: its backend would otherwise stay on a stale index unnoticed
        (``live`` is False from now on, so routing falls back to the estimate)."""
        if not task.cancelled() and task.exception() is not None:
            log.error("kv events: feed %s stopped", task.get_name(), exc_info=task.exception())
            if self._feeds.get(name) is not None and self._feeds[name].task is task:
                self._sink.on_stopped(name)
