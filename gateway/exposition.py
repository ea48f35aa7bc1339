"""The ``/metrics`` page: gauges sampled from live state at scrape time, then the exposition.

Why at scrape time: backend load, queue depths and breaker states change on every request;
setting a gauge on each change would cost the request path, while a scrape every few seconds
reads them once. Per-request samples are applied in bulk here too (``Metrics.exposition``).
"""

from __future__ import annotations

from gateway.backends import BackendPool
from gateway.breaker import BreakerState
from gateway.dispatch import Dispatcher
from gateway.policy.snapshot import PolicySnapshot
from gateway.policy.watch import PolicySource
from gateway.telemetry import Metrics
from gateway.tracelog import TraceLog

BREAKER_LEVELS = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


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
    classes = snapshot.policy.classes
    rank_names = {c.rank: name for name, c in classes.items()}
    for name, priority_class in classes.items():
        m.slo_objective.labels(name).set(priority_class.slo.objective)
    for state in pool.all():
        capacity, quota = state.backend.capacity, state.quota
        m.fleet_quota_requests.labels(state.name).set(quota.requests if quota else capacity.max_concurrent)
        m.fleet_quota_tokens.labels(state.name).set(quota.tokens if quota else capacity.max_tokens_in_flight)
        m.in_flight.labels(state.name).set(state.in_flight)
        m.in_flight_tokens.labels(state.name).set(state.in_flight_tokens)
        m.backend_healthy.labels(state.name).set(1 if state.healthy else 0)
        m.backend_kv_usage.labels(state.name).set(state.kv_usage)
        m.backend_waiting.labels(state.name).set(state.waiting)
        if state.breaker is not None:
            m.breaker_state.labels(state.name).set(BREAKER_LEVELS[state.breaker.state])
        for rank, name in rank_names.items():
            m.class_in_flight.labels(state.name, name).set(state.class_in_flight.get(rank, 0))
    for model, queues in dispatcher.queues().items():
        m.model_healthy_backends.labels(model).set(sum(1 for s in pool.for_model(model) if s.healthy))
        for queue in queues.classes:  # a model's queue depth sums its lanes (``Dispatcher.depth``)
            m.queue_depth.labels(model, queue.name).set(dispatcher.depth(model, queue.rank))
            m.queue_capacity.labels(model, queue.name).set(queue.policy.queue.max_depth)
    for result, count in (
        ("ok", source.reloads_ok),
        ("invalid", source.reloads_invalid),
        ("refused", source.reloads_refused),
    ):
        m.policy_reloads.labels(result).set(count)
    if trace_log is not None:
        m.advance(m.trace_log_dropped, trace_log.dropped)
    return m.exposition()
