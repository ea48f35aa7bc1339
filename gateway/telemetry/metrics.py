"""Every metric the gateway exports, with its name, labels and buckets, in one place.

Label sets are bounded: ``model`` and ``backend`` come from the policy (a request for an
unknown model is counted under ``model="-"``), ``class`` from the policy's classes, ``api``
from the registered dialects (``gateway/dialects/registry.py``: the dialect's ``name``), and
``status``/``outcome`` from small fixed sets. Request ids never become labels.
Every per-request latency, token and goodput metric carries ``api`` beside ``model`` (and
``class``), so each API can be broken out; queries that ``sum by`` other labels add it up.
Buckets follow LLM latencies: TTFT from 10 ms to 60 s, inter-token latency from 1 ms to
2 s, end-to-end up to 10 minutes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

TTFT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1,
    1.5,
    2,
    3,
    5,
    7.5,
    10,
    20,
    30,
    60,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1,
    2,
)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)

MATCHED_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

UNKNOWN_LABEL = "-"


class PendingSamples:
    """Per-request samples kept as plain numbers, applied to the Prometheus metrics in bulk.

    Why: recording a finished request touches a dozen labelled series; through
    ``prometheus_client`` each costs a label lookup, a lock and, for a histogram, a linear scan
    of its buckets: together about a tenth of the gateway's CPU per request at saturation
    (``loadtests/proofs/telemetry_overhead.py``). Here a sample is one dict update (counters) or one
    list append (histograms) keyed by the metric and its label values; ``apply`` turns them
    into one ``inc`` per series and one bulk histogram update (``Metrics.observe_many``). It
    runs before every scrape, so ``/metrics`` is always exact, and whenever ``limit`` samples
    are pending, so memory stays bounded when nobody scrapes.
    """

    __slots__ = ("_apply_to", "counts", "limit", "observations", "size")

    def __init__(self, apply_to: Metrics, limit: int = 4096) -> None:
        self._apply_to = apply_to
        self.limit = limit
        self.counts: dict[tuple[Counter, tuple[str, ...]], float] = {}
        self.observations: dict[tuple[Histogram, tuple[str, ...]], list[float]] = {}
        self.size = 0

    def inc(self, metric: Counter, labels: tuple[str, ...], amount: float = 1.0) -> None:
        key = (metric, labels)
        counts = self.counts
        counts[key] = counts.get(key, 0.0) + amount

    def observe(self, metric: Histogram, labels: tuple[str, ...], value: float) -> None:
        key = (metric, labels)
        values = self.observations.get(key)
        if values is None:
            values = self.observations[key] = []
        values.append(value)
        self.size += 1
        if self.size >= self.limit:
            self.apply()

    def observe_all(self, metric: Histogram, labels: tuple[str, ...], values: Sequence[float]) -> None:
        key = (metric, labels)
        pending = self.observations.get(key)
        if pending is None:
            pending = self.observations[key] = []
        pending.extend(values)
        self.size += len(values)
        if self.size >= self.limit:
            self.apply()

    def apply(self) -> None:
        metrics = self._apply_to
        counts, self.counts = self.counts, {}
        observations, self.observations = self.observations, {}
        self.size = 0
        for (counter, labels), amount in counts.items():
            metrics.child(counter, *labels).inc(amount)
        for (histogram, labels), values in observations.items():
            metrics.observe_many(metrics.child(histogram, *labels), values)


class ConnectionCounts(Protocol):
    """Counts the server's listeners keep (``gateway.server.connections.Listeners``)."""

    def open_connections(self) -> Mapping[str, int]: ...

    def closed_connections(self) -> Mapping[tuple[str, str], int]: ...


class Metrics:
    """The gateway's Prometheus metrics, on a registry of its own (no process globals).

    ``Metrics(redis=True)`` when the limits live in Redis: only then are the Redis metrics
    exported (see ``_declare_state_metrics``)."""

    def __init__(self, *, redis: bool = False) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self._declare_request_metrics(r)
        self._declare_backend_metrics(r)
        self._declare_admission_metrics(r)
        self._declare_routing_metrics(r)
        self._declare_kv_event_metrics(r)
        self._declare_slo_metrics(r)
        self._declare_cost_metrics(r)
        self._declare_trace_log_metrics(r)
        self._declare_state_metrics(r if redis else None)
        self._declare_fleet_metrics(r)
        self._declare_group_metrics(r)
        self._declare_connection_metrics(r)
        self._advanced: dict[int, float] = {}
        self.pending = PendingSamples(self)

    def _declare_request_metrics(self, r: CollectorRegistry) -> None:
        """Requests and their latencies, by model, API and class."""
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by model, API, priority class, HTTP status and outcome.",
            ["model", "api", "class", "status", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "gateway_ttft_seconds",
            "Time from the gateway accepting a request to the first chunk with generated output.",
            ["model", "api", "class"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "gateway_itl_seconds",
            "Gaps between successive output chunks of a stream.",
            ["model", "api", "class"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "gateway_e2e_seconds",
            "Time from the gateway accepting a request to its last byte.",
            ["model", "api", "class"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens processed, from the backends' usage reports, by API and direction (input, output).",
            ["model", "api", "direction"],
            registry=r,
        )

    def _declare_backend_metrics(self, r: CollectorRegistry) -> None:
        """Backends: work in flight, health, breakers, scraped saturation."""
        self.in_flight = Gauge(
            "gateway_backend_in_flight_requests", "Requests in flight to a backend.", ["backend"], registry=r
        )
        self.in_flight_tokens = Gauge(
            "gateway_backend_in_flight_tokens",
            "Tokens (prompt plus max_tokens) reserved by requests in flight to a backend.",
            ["backend"],
            registry=r,
        )
        self.class_in_flight = Gauge(
            "gateway_class_in_flight_requests",
            "Requests in flight to a backend, by priority class.",
            ["backend", "class"],
            registry=r,
        )
        self.backend_healthy = Gauge(
            "gateway_backend_healthy",
            "1 when the backend's last health check passed.",
            ["backend"],
            registry=r,
        )
        self.breaker_state = Gauge(
            "gateway_breaker_state",
            "Circuit breaker of a backend: 0 closed, 1 half-open, 2 open.",
            ["backend"],
            registry=r,
        )
        self.backend_kv_usage = Gauge(
            "gateway_backend_kv_cache_usage_ratio",
            "KV-cache usage 0-1 from the backend's last /metrics scrape.",
            ["backend"],
            registry=r,
        )
        self.backend_waiting = Gauge(
            "gateway_backend_waiting_requests",
            "Requests waiting inside the engine, from its last /metrics scrape.",
            ["backend"],
            registry=r,
        )
        self.backend_capacity_disagreement = Gauge(
            "gateway_backend_capacity_disagreement",
            "1 when the backend's declared capacity field disagrees with its engine's own limit, else 0.",
            ["backend", "field"],
            registry=r,
        )
        self.backend_engine_limit = Gauge(
            "gateway_backend_engine_limit",
            "The engine's own limit (max_concurrent, kv_cache_tokens), as it reports it.",
            ["backend", "field"],
            registry=r,
        )
        self.backend_held = Gauge(
            "gateway_backend_held",
            "1 while the backend takes no new request whatever its room, by reason: engine_queue (its engine "
            "has requests waiting in its own queue, above capacity.max_waiting), engine_limits_unread "
            "(capacity: auto not read from the engine yet: the backend is not ready); else 0.",
            ["backend", "reason"],
            registry=r,
        )
        self.model_healthy_backends = Gauge(
            "gateway_model_healthy_backends", "Healthy backends serving the model.", ["model"], registry=r
        )

    def _declare_admission_metrics(self, r: CollectorRegistry) -> None:
        """Queues and refusals."""
        self.queue_depth = Gauge(
            "gateway_queue_depth", "Requests waiting for a backend.", ["model", "class"], registry=r
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time a dispatched request waited in the gateway's queue (0 on the fast path).",
            ["model", "class"],
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.rejections = Counter(
            "gateway_rejections",
            "Requests refused by admission (429 tenant limits, 503 overload), by reason code.",
            ["reason", "class", "tenant"],
            registry=r,
        )
        self.queue_capacity = Gauge(
            "gateway_queue_capacity", "The queue's max_depth from the policy.", ["model", "class"], registry=r
        )

    def _declare_cache_truth_metrics(self, r: CollectorRegistry) -> None:
        """What the engines said they reused of each prompt, beside what routing predicted
        (``gateway/dispatch/cache_report.py``); only for answers of engines that say it."""
        labels = ["backend", "model"]
        self.predicted_cached_tokens = Counter(
            "gateway_predicted_cached_tokens",
            "Prompt tokens the router expected the engine to hold (its matched share of the prompt, in the "
            "engine's tokens), over the answers of engines that report what they reused.",
            labels,
            registry=r,
        )
        self.confirmed_cached_tokens = Counter(
            "gateway_predicted_cached_tokens_confirmed",
            "Of the predicted cached tokens, those the engine said it reused (min of the two per answer): "
            "over gateway_predicted_cached_tokens_total, the prediction's precision.",
            labels,
            registry=r,
        )
        self.engine_cached_tokens = Counter(
            "gateway_engine_cached_tokens",
            "Prompt tokens the engine said it reused from its cache (usage.prompt_tokens_details.cached_tokens, "
            "llama.cpp's timings.cache_n).",
            labels,
            registry=r,
        )
        self.engine_computed_prompt_tokens = Counter(
            "gateway_engine_computed_prompt_tokens",
            "Prompt tokens the engine computed (its prompt less what it reused): the prefill routing did not save.",
            labels,
            registry=r,
        )
        self.prefix_cache_misses = Counter(
            "gateway_prefix_cache_misses",
            "Answers whose engine held less of the prompt than the router predicted (by more than two of its blocks): "
            "each makes the router forget what that engine was sent no later than the missing block.",
            labels,
            registry=r,
        )

    def _declare_kv_event_metrics(self, r: CollectorRegistry) -> None:
        """The engines' KV-event feeds (``gateway/dispatch/kv_feeds.py``): one per backend with
        ``kv_events`` in the policy; a backend leaving the policy leaves these too."""
        self.kv_events_hashing_mismatch = Gauge(
            "gateway_kv_events_hashing_mismatch",
            "1 when the backend's kv_events.hashing was judged not to be its engine's (its index never matched "
            "a prompt the engine said it reused): the backend routes on the estimate until a reload fixes it.",
            ["backend"],
            registry=r,
        )
        self.kv_events_feed_live = Gauge(
            "gateway_kv_events_feed_live",
            "1 while the backend's KV-event feed is in sequence and heard from within its silence_s; "
            "0 while it is not (routing then uses the gateway's own estimate).",
            ["backend"],
            registry=r,
        )
        self.kv_events_feed_lost = Counter(
            "gateway_kv_events_feed_lost",
            "Times a backend's KV-event feed stopped being live: silent, gap_unreplayed (a gap the replay "
            "socket could not fill: the index was emptied), decode_error.",
            ["backend", "reason"],
            registry=r,
        )
        self.kv_events_batches = Counter(
            "gateway_kv_events_batches",
            "KV-event batches applied to the backend's exact block index (replayed ones included, and the "
            "index's own resets after a gap or an engine restart).",
            ["backend"],
            registry=r,
        )
        self.kv_events_blocks = Gauge(
            "gateway_kv_events_blocks",
            "Block hashes the backend's exact index holds, as its engine's KV events say.",
            ["backend"],
            registry=r,
        )

    def _declare_routing_metrics(self, r: CollectorRegistry) -> None:
        """Routing decisions and retries."""
        self.routing_decisions = Counter(
            "gateway_routing_decisions",
            "Backends chosen, by model, routing strategy and reason code (prefix_match, load_bound, ...).",
            ["model", "strategy", "reason"],
            registry=r,
        )
        self.routing_prefix_source = Counter(
            "gateway_routing_prefix_source",
            "Prefix-aware decisions by where the chosen backend's match came from: events (the engine's own "
            "KV events) or estimate (the gateway's index of what it sent where).",
            ["model", "source"],
            registry=r,
        )
        self.matched_blocks = Histogram(
            "gateway_routing_matched_prefix_blocks",
            "Prompt prefix blocks the chosen backend was expected to hold (prefix-aware strategies).",
            ["model", "strategy"],
            buckets=MATCHED_BLOCK_BUCKETS,
            registry=r,
        )
        self._declare_cache_truth_metrics(r)
        self.routing_pick = Histogram(
            "gateway_routing_pick_seconds",
            "CPU time of choosing a backend (prefix hashing, index lookups, scoring).",
            ["model", "strategy"],
            buckets=(0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01),
            registry=r,
        )
        self.retries = Counter(
            "gateway_upstream_retries",
            "Attempts retried on another backend, by the backend that failed and the failure's code.",
            ["backend", "reason"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "gateway_retry_budget_exhausted",
            "Retries refused because the retry budget (a share of recent requests) was spent.",
            ["model"],
            registry=r,
        )
        self.trace_spans_dropped = Counter(
            "gateway_trace_spans_dropped",
            "Spans not exported: the export queue was full or the collector failed (gateway/telemetry/otlp.py).",
            registry=r,
        )
        self.migrations = Counter(
            "gateway_stream_migrations",
            "Streams broken mid-way, by model and what became of them: continued on another backend, "
            "or ended with an error event (not_continuable, attempts_exhausted, deadline, budget_exhausted).",
            ["model", "outcome"],
            registry=r,
        )

    def _declare_slo_metrics(self, r: CollectorRegistry) -> None:
        """Goodput against each class's SLO, and the policy in force."""
        self.slo_requests = Counter(
            "gateway_slo_requests",
            "Requests judged against their class's SLO (all but those the client caused).",
            ["model", "api", "class"],
            registry=r,
        )
        self.goodput_requests = Counter(
            "gateway_goodput_requests",
            "Requests that succeeded and met every SLO of their class.",
            ["model", "api", "class"],
            registry=r,
        )
        self.goodput_tokens = Counter(
            "gateway_goodput_output_tokens",
            "Output tokens of the goodput requests.",
            ["model", "api", "class"],
            registry=r,
        )
        self.slo_objective = Gauge(
            "gateway_slo_objective_ratio", "The class's SLO attainment objective.", ["class"], registry=r
        )
        self.policy_reloads = Gauge(
            "gateway_policy_reloads",
            "Policy reloads since start, by result (ok: swapped in; invalid: rejected, old one kept).",
            ["result"],
            registry=r,
        )
        self.policy_info = Gauge(
            "gateway_policy_info", "The policy version in force (value 1).", ["version", "digest"], registry=r
        )

    def _declare_cost_metrics(self, r: CollectorRegistry) -> None:
        """Dollars attributed per accounting interval (``telemetry/cost.py``, ``cost_meter.py``).

        Cost per goodput request is ``rate(gateway_cost_dollars_total) /
        rate(gateway_cost_goodput_requests_total)``; dollars plus unattributed dollars add up
        to the bill (the price gauge times the time)."""
        cost_labels = ["tenant", "model", "class"]
        self.cost_dollars = Counter(
            "gateway_cost_dollars",
            "Dollars of backend time attributed to requests (their tokens' share of each interval).",
            cost_labels,
            registry=r,
        )
        self.cost_requests = Counter(
            "gateway_cost_requests", "Requests charged, in the intervals they finished in.", cost_labels, registry=r
        )
        self.cost_goodput_requests = Counter(
            "gateway_cost_goodput_requests",
            "Goodput requests (met every SLO of their class) charged, in the intervals they finished in.",
            cost_labels,
            registry=r,
        )
        self.cost_unattributed = Counter(
            "gateway_cost_unattributed_dollars",
            "Dollars of intervals in which a priced backend finished no request (idle, down or drained).",
            ["backend"],
            registry=r,
        )
        self.cost_per_goodput_request = Gauge(
            "gateway_cost_per_goodput_request_dollars",
            "Dollars attributed over goodput requests since start, by model and class.",
            ["model", "class"],
            registry=r,
        )
        self.backend_price = Gauge(
            "gateway_cost_backend_price_dollars_per_hour",
            "What a priced backend costs an hour (price per GPU-hour times GPUs), from the policy.",
            ["backend"],
            registry=r,
        )

    def _declare_trace_log_metrics(self, r: CollectorRegistry) -> None:
        """The request trace log's losses (``gateway/telemetry/tracelog.py``)."""
        self.trace_log_dropped = Counter(
            "gateway_trace_log_dropped",
            "Trace-log records dropped: the writer's buffer was full, or the disk refused them.",
            registry=r,
        )

    def _declare_state_metrics(self, r: CollectorRegistry | None) -> None:
        """Shared state in Redis: its health as every user of the process's shared store finds it
        (``gateway/shared/store.py``), the limit store's errors and fallbacks
        (``gateway/limitstore/redis.py``). Registered (``r``) only when the policy puts the state in
        Redis: a gateway without Redis exports no ``gateway_redis_up``, so an alert on
        ``gateway_redis_up == 0`` never fires for it."""
        self.redis_up = Gauge(
            "gateway_redis_up",
            "1 when the last Redis command or ping succeeded, 0 when Redis is unreachable or slower "
            "than state.timeout_ms (any user of the shared store: limits, ledger, prefix view, responses, rollouts).",
            registry=r,
        )
        self.redis_errors = Counter(
            "gateway_redis_errors",
            "Redis commands that failed or timed out, by limit-store operation (ping included).",
            ["operation"],
            registry=r,
        )
        self.redis_fallbacks = Counter(
            "gateway_redis_fallback_operations",
            "Limit-store operations answered by this replica's in-memory fallback while Redis was down.",
            ["operation"],
            registry=r,
        )

    def _declare_fleet_metrics(self, r: CollectorRegistry) -> None:
        """This process's part of every backend's capacity (``gateway/fleet/``)."""
        self.fleet_quota_requests = Gauge(
            "gateway_fleet_quota_requests",
            "Requests this process may have in flight on a backend: its part of the backend's max_concurrent.",
            ["backend"],
            registry=r,
        )
        self.fleet_quota_tokens = Gauge(
            "gateway_fleet_quota_tokens",
            "Tokens this process may have in flight on a backend: its part of max_tokens_in_flight.",
            ["backend"],
            registry=r,
        )
        self.fleet_processes = Gauge(
            "gateway_fleet_processes",
            "Gateway processes sharing the backends' capacity, as last seen (1 alone).",
            registry=r,
        )
        self.fleet_syncs = Counter(
            "gateway_fleet_syncs",
            "Syncs with the fleet's capacity ledger in Redis, by result (ok, failed: on fallback shares).",
            ["result"],
            registry=r,
        )
        self.fleet_prefix_decisions = Counter(
            "gateway_fleet_prefix_decisions",
            "Routing decisions in the fleet's prefix view: published by this process, received "
            "(folded into its index) from the others, or dropped (Redis unreachable, backlog full); "
            "correction_received: another process's engine held less than predicted, its index corrected.",
            ["result"],
            registry=r,
        )

    def _declare_group_metrics(self, r: CollectorRegistry) -> None:
        """Model groups: which target served, fallbacks, shadow traffic, rollouts (``gateway/policy/groups.py``)."""
        self.group_requests = Counter(
            "gateway_group_requests",
            "Requests to a model group by the target first chosen for them and its role "
            "(weighted, baseline, candidate).",
            ["group", "target", "role"],
            registry=r,
        )
        self.fallbacks = Counter(
            "gateway_fallbacks",
            "Requests of a model group sent down its fallback chain, by the target they left, the one they "
            "went to, and why (no_room, unavailable, refused, failed).",
            ["group", "from_target", "to_target", "reason"],
            registry=r,
        )
        self.shadow_requests = Counter(
            "gateway_shadow_requests",
            "Shadow copies of a group's requests, by target and outcome (completed, error, no_room, "
            "at_cap, preempted, cancelled).",
            ["group", "target", "outcome"],
            registry=r,
        )
        self.shadow_ttft = Histogram(
            "gateway_shadow_ttft_seconds",
            "Time to first token of shadow requests, from their dispatch.",
            ["group", "target"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.shadow_itl = Histogram(
            "gateway_shadow_itl_seconds",
            "Gaps between output events of shadow requests.",
            ["group", "target"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.shadow_output_tokens = Counter(
            "gateway_shadow_output_tokens",
            "Output tokens of shadow answers (engine usage), beside gateway_tokens_total of the primaries.",
            ["group", "target"],
            registry=r,
        )
        self.shadow_quality = Histogram(
            "gateway_shadow_quality_score",
            "The quality scorer's comparison of a shadow answer with the primary's (0 unlike, 1 alike).",
            ["group", "target", "scorer"],
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
            registry=r,
        )
        self.rollout_percent = Gauge(
            "gateway_rollout_candidate_percent",
            "The share of its rollout's traffic a candidate target gets now (0 after a rollback).",
            ["group", "candidate"],
            registry=r,
        )
        self.rollout_status = Gauge(
            "gateway_rollout_status",
            "1 for the state each rollout is in (progressing, holding, promoted, rolled_back), 0 for the others.",
            ["group", "candidate", "status"],
            registry=r,
        )
        self.rollout_decisions = Counter(
            "gateway_rollout_decisions",
            "Canary verdicts by action (promote, hold, rollback, complete; continue: an operator's resume) and who "
            "took them (canary, operator).",
            ["group", "candidate", "action", "by"],
            registry=r,
        )
        self.rollout_evidence = Gauge(
            "gateway_rollout_evidence",
            "The current step's log likelihood ratio of 'the candidate is worse', by signal; the rollback "
            "threshold is gateway_rollout_threshold.",
            ["group", "candidate", "signal"],
            registry=r,
        )
        self.rollout_threshold = Gauge(
            "gateway_rollout_threshold",
            "The log likelihood ratio at which a rollout rolls back (log(signals x steps / alpha)).",
            ["group", "candidate"],
            registry=r,
        )

    def _declare_connection_metrics(self, r: CollectorRegistry) -> None:
        """Client connections and what their guards closed (``gateway/server/connections.py``)."""
        self.connections_open = Gauge(
            "gateway_connections_open", "Open client connections, by listener (api, admin).", ["listener"], registry=r
        )
        self.upstream_connections_open = Gauge(
            "gateway_upstream_connections_open",
            "Open connections from the gateway to its backends, in use or idle and kept alive "
            "(the data plane's pool, gateway/upstream/wire.py; at most --max-upstream-connections).",
            registry=r,
        )
        self.connections_closed = Counter(
            "gateway_connections_closed",
            "Client connections the gateway closed or refused, by listener and reason: header_timeout, "
            "header_too_large (431), body_timeout (408), keepalive_timeout, evicted_idle (the longest idle, "
            "closed at max_connections for a new one), refused (503 at max_connections with none idle).",
            ["listener", "reason"],
            registry=r,
        )

    def export_connections(self, counts: ConnectionCounts) -> None:
        """Bring the connection metrics up to the listeners' own counts (at scrape time)."""
        for listener, count in counts.open_connections().items():
            self.child(self.connections_open, listener).set(count)
        for (listener, reason), total in counts.closed_connections().items():
            self.advance(self.child(self.connections_closed, listener, reason), total)

    def advance(self, counter: Counter, total: float) -> None:
        """Bring an unlabelled counter (or one labelled child, from ``child``) up to ``total``, a
        count another component keeps (``TraceLog.dropped``), at scrape time: no call on that
        component's path."""
        last = self._advanced.get(id(counter), 0.0)
        if total > last:
            counter.inc(total - last)
            self._advanced[id(counter)] = total

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, memoised: the request path records about ten samples per
        request and ``labels()`` costs 2-3 µs each; label sets are bounded, so is the memo."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def remove_child(self, metric: MetricWrapperBase, *labels: str) -> None:
        """Drop one labelled series and its memo (``child``): a backend that left, a feed that
        stopped. A series never exported is no error."""
        self._children.pop((id(metric), labels), None)
        try:
            metric.remove(*labels)
        except KeyError:
            return

    @staticmethod
    def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
        """``histogram.observe(v)`` for every ``v``, at a quarter of the cost.

        A stream of N tokens has N-1 inter-token gaps; ``observe`` takes ~0.8 µs each (a lock
        per bucket write and a linear scan of the buckets), 50 µs for a 64-token stream. Here
        each value is binned by bisection and every touched bucket written once. It relies on
        ``prometheus_client``'s ``_upper_bounds``, ``_buckets`` and ``_sum``: the test
        ``test_observe_many_matches_observe`` fails if an upgrade changes them.
        """
        bounds = histogram._upper_bounds
        counts: dict[int, int] = {}
        for value in values:
            index = bisect_left(bounds, value)
            counts[index] = counts.get(index, 0) + 1
        buckets = histogram._buckets
        for index, count in counts.items():
            buckets[index].inc(count)
        histogram._sum.inc(sum(values))

    def exposition(self) -> bytes:
        self.pending.apply()
        return generate_latest(self.registry)
