"""The ``/metrics`` page: gauges sampled from live state at scrape time, then the exposition.

Why at scrape time: backend load, queue depths and breaker states change on every request;
setting a gauge on each change would cost the request path, while a scrape every few seconds
reads them once. Per-request samples are applied in bulk here too (``Metrics.exposition``).

A gauge series sampled here exists only while what it describes does: a backend, a model or a
class that a reload removed loses its series at the next scrape (``LiveGauges``), so that an
alert on a backend's health or breaker stops firing for a backend that is gone, instead of
showing its last value until the process restarts.
"""

from __future__ import annotations

from prometheus_client import Gauge

from gateway.dispatch.backends import BackendPool
from gateway.dispatch.breaker import BreakerState
from gateway.dispatch.capacity import Held, held
from gateway.dispatch.dispatcher import Dispatcher
from gateway.policy.snapshot import PolicySnapshot
from gateway.policy.watch import PolicySource
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracelog import TraceLog

BREAKER_LEVELS = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class LiveGauges:
    """One scrape's gauge samples: ``set`` them, then ``sweep`` removes every series not set."""

    def __init__(self) -> None:
        self._set: dict[Gauge, set[tuple[str, ...]]] = {}

    def set(self, gauge: Gauge, labels: tuple[str, ...], value: float) -> None:
        gauge.labels(*labels).set(value)
        self._set.setdefault(gauge, set()).add(labels)

    def sweep(self, gauges: list[Gauge]) -> None:
        for gauge in gauges:
            live = self._set.get(gauge, set())
            for metric in gauge.collect():
                stale = {tuple(sample.labels.values()) for sample in metric.samples} - live
                for labels in stale:
                    gauge.remove(*labels)


def expose(
    metrics: Metrics,
    snapshot: PolicySnapshot,
    pool: BackendPool,
    dispatcher: Dispatcher,
    source: PolicySource,
    trace_log: TraceLog | None,
) -> bytes:
    """Sample the live gauges, then render every metric in the Prometheus text format."""
    m = metrics
    live = LiveGauges()
    classes = snapshot.policy.classes
    rank_names = {c.rank: name for name, c in classes.items()}
    now, fresh_s = dispatcher.clock.now(), snapshot.policy.scrape.fresh_s
    for name, priority_class in classes.items():
        live.set(m.slo_objective, (name,), priority_class.slo.objective)
    for state in pool.all():
        capacity, quota, backend = state.backend.capacity, state.quota, (state.name,)
        live.set(m.fleet_quota_requests, backend, quota.requests if quota else capacity.max_concurrent)
        live.set(m.fleet_quota_tokens, backend, quota.tokens if quota else capacity.max_tokens_in_flight)
        live.set(m.in_flight, backend, state.in_flight)
        live.set(m.in_flight_tokens, backend, state.in_flight_tokens)
        live.set(m.backend_healthy, backend, 1 if state.healthy else 0)
        live.set(m.backend_kv_usage, backend, state.kv_usage)
        live.set(m.backend_waiting, backend, state.waiting)
        why = held(state, now, fresh_s)
        for reason in Held:
            live.set(m.backend_held, (state.name, reason.value), 1 if reason is why else 0)
        if state.breaker is not None:
            live.set(m.breaker_state, backend, BREAKER_LEVELS[state.breaker.state])
        for rank, name in rank_names.items():
            live.set(m.class_in_flight, (state.name, name), state.class_in_flight.get(rank, 0))
    for model, queues in dispatcher.queues().items():
        live.set(m.model_healthy_backends, (model,), sum(1 for s in pool.for_model(model) if s.healthy))
        for queue in queues.classes:  # a model's queue depth sums its lanes (``Dispatcher.depth``)
            live.set(m.queue_depth, (model, queue.name), dispatcher.depth(model, queue.rank))
            live.set(m.queue_capacity, (model, queue.name), queue.policy.queue.max_depth)
    live.sweep(
        [
            m.slo_objective, m.fleet_quota_requests, m.fleet_quota_tokens, m.in_flight, m.in_flight_tokens,
            m.backend_healthy, m.backend_kv_usage, m.backend_waiting, m.backend_held, m.breaker_state,
            m.class_in_flight, m.model_healthy_backends, m.queue_depth, m.queue_capacity,
        ]
    )  # fmt: skip
    for result, count in (
        ("ok", source.reloads_ok),
        ("invalid", source.reloads_invalid),
        ("refused", source.reloads_refused),
    ):
        m.policy_reloads.labels(result).set(count)
    if trace_log is not None:
        m.advance(m.trace_log_dropped, trace_log.dropped)
    return m.exposition()
