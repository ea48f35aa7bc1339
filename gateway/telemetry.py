"""Every metric the gateway exports, with its name, labels and buckets, in one place.

Label sets are bounded: ``model`` and ``backend`` come from the policy (a request for an
unknown model is counted under ``model="-"``), ``class`` from the policy's classes, and
``status``/``outcome`` from small fixed sets. Request ids never become labels.
Buckets follow LLM latencies: TTFT from 10 ms to 60 s, inter-token latency from 1 ms to
2 s, end-to-end up to 10 minutes.
"""

from __future__ import annotations

from typing import Any, TypeVar

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


class Metrics:
    """The gateway's Prometheus metrics, on a registry of its own (no process globals)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self._declare_request_metrics(r)
        self._declare_backend_metrics(r)
        self._declare_admission_metrics(r)
        self._declare_routing_metrics(r)
        self._declare_slo_metrics(r)

    def _declare_request_metrics(self, r: CollectorRegistry) -> None:
        """Requests and their latencies, by model and class."""
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by model, API, priority class, HTTP status and outcome.",
            ["model", "api", "class", "status", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "gateway_ttft_seconds",
            "Time from the gateway accepting a request to the first chunk with generated output.",
            ["model", "class"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "gateway_itl_seconds",
            "Gaps between successive output chunks of a stream.",
            ["model", "class"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "gateway_e2e_seconds",
            "Time from the gateway accepting a request to its last byte.",
            ["model", "class"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens processed, from the backends' usage reports, by direction (input, output).",
            ["model", "direction"],
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

    def _declare_routing_metrics(self, r: CollectorRegistry) -> None:
        """Routing decisions and retries."""
        self.routing_decisions = Counter(
            "gateway_routing_decisions",
            "Backends chosen, by model, routing strategy and reason code (prefix_match, load_bound, ...).",
            ["model", "strategy", "reason"],
            registry=r,
        )
        self.matched_blocks = Histogram(
            "gateway_routing_matched_prefix_blocks",
            "Prompt prefix blocks the chosen backend was expected to hold (prefix-aware strategies).",
            ["model", "strategy"],
            buckets=MATCHED_BLOCK_BUCKETS,
            registry=r,
        )
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

    def _declare_slo_metrics(self, r: CollectorRegistry) -> None:
        """Goodput against each class's SLO, and the policy in force."""
        self.slo_requests = Counter(
            "gateway_slo_requests",
            "Requests judged against their class's SLO (all but those the client caused).",
            ["model", "class"],
            registry=r,
        )
        self.goodput_requests = Counter(
            "gateway_goodput_requests",
            "Requests that succeeded and met every SLO of their class.",
            ["model", "class"],
            registry=r,
        )
        self.goodput_tokens = Counter(
            "gateway_goodput_output_tokens", "Output tokens of the goodput requests.", ["model", "class"], registry=r
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

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, memoised: the request path records about ten samples per
        request and ``labels()`` costs 2-3 µs each; label sets are bounded, so is the memo."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
