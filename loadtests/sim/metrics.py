"""Prometheus metrics of one engine, under vLLM's names, in a registry of its own.

Several engines share a process, so nothing goes to the global registry. Labels are
``model_name`` and ``engine`` (the engine's index in its process), as vLLM V1.

Beyond vLLM's set: ``sim:requests_aborted_total`` counts aborts (client disconnects) — vLLM V1
also counts them as ``vllm:request_success_total{finished_reason="abort"}``, which is kept too —
``sim:step_lag_seconds`` records how late each step ran against its roofline deadline, and
``sim:faults_injected_total{mode}`` counts requests hit by an injected fault (``faults.py``).

``vllm:cache_config_info`` is vLLM's "info" gauge (``PrometheusStatLogger.log_metrics_info``: a gauge
set to 1 whose labels are ``CacheConfig.metrics_info()``, every field as ``str(value)``, then
``engine``); the simulator writes the fields a reader of the engine's limits needs
(``num_gpu_blocks`` and ``block_size``: the KV cache holds their product in tokens) and a few
others with vLLM's defaults, and only for an engine that has a KV cache.
Histograms measure wall-clock seconds as a client sees them (already multiplied by the time scale).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LAG_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
FINISH_REASONS = ("length", "stop", "abort")
FAULT_MODES = ("fail_503", "stall", "close_mid_stream")
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks", "num_cpu_blocks")
"""Labels of ``vllm:cache_config_info`` (a subset of vLLM's ``CacheConfig`` fields, in its order), ``engine`` last."""


def _kv_blocks(kv_usage: Callable[[], float]) -> tuple[int, int] | None:
    """``(num_blocks, block_size)`` of the KV cache whose ``usage`` is ``kv_usage``; None without one.

    Read from the bound method's owner (``kvcache.KVCache``) so that every engine built with a
    KV cache reports its size without its constructor passing it twice."""
    owner = getattr(kv_usage, "__self__", None)
    blocks, block_size = getattr(owner, "num_blocks", None), getattr(owner, "block_size", None)
    if isinstance(blocks, int) and isinstance(block_size, int):
        return blocks, block_size
    return None


class _ByPriority(Collector):
    """``sim:num_requests_by_priority{priority}``: requests in the engine by priority, at scrape time
    (or another count by priority under ``name``: the high-water marks)."""

    def __init__(
        self,
        counts: dict[int, int],
        values: tuple[str, str],
        name: str = "sim:num_requests_by_priority",
        doc: str = "Requests in the engine (running or waiting), by their priority field.",
    ) -> None:
        self._counts = counts
        self._values = values
        self._name = name
        self._doc = doc

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name, self._doc, labels=["model_name", "engine", "priority"])
        for priority, count in sorted(self._counts.items()):
            family.add_metric([*self._values, str(priority)], count)
        yield family


class EngineMetrics:
    """Every metric of one engine; gauges are read from the engine at scrape time."""

    def __init__(
        self,
        model_name: str,
        engine: int,
        *,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        names = ["model_name", "engine"]
        values = (model_name, str(engine))
        reg = self.registry
        self.in_engine: dict[int, int] = {}
        """Requests in the engine (running or waiting) by their ``priority`` field: what a bench
        reads to check a class's share of an engine (the gateway sends the class rank there)."""
        reg.register(_ByPriority(self.in_engine, values))
        self.held_max = 0
        """The most requests the engine ever held at once (running or waiting), counted at every
        submission: a bench's exact peak, with no sampling interval for a spike to fall between."""
        self.held_max_by_priority: dict[int, int] = {}
        reg.register(
            _ByPriority(
                self.held_max_by_priority,
                values,
                "sim:requests_held_max_by_priority",
                "The most requests of each priority the engine held at once since it started.",
            )
        )

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, names, registry=reg).labels(*values).set_function(fn)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(*values)

        gauge("vllm:num_requests_running", "Requests in the running batch.", running)
        gauge(
            "sim:requests_held_max",
            "The most requests the engine held at once since it started.",
            lambda: self.held_max,
        )
        gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1.", kv_usage)
        kv_blocks = _kv_blocks(kv_usage)
        if kv_blocks is not None:
            info = Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                [*CACHE_CONFIG_LABELS, "engine"],
                registry=reg,
            )
            info.labels(str(kv_blocks[1]), "auto", "True", str(kv_blocks[0]), "None", str(engine)).set(1)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (recompute).")
        self.aborted = counter("sim:requests_aborted", "Requests aborted by a client disconnect.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.step_lag = histogram("sim:step_lag_seconds", "Lateness of steps vs their deadline.", LAG_BUCKETS)
        success = Counter(
            "vllm:request_success", "Finished requests by reason.", [*names, "finished_reason"], registry=reg
        )
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        faults = Counter("sim:faults_injected", "Requests hit by an injected fault.", [*names, "mode"], registry=reg)
        self.faults = {mode: faults.labels(*values, mode) for mode in FAULT_MODES}

    def submitted(self, priority: int) -> None:
        """A request entered the engine: count it, and move the high-water marks."""
        self.in_engine[priority] = self.in_engine.get(priority, 0) + 1
        self.held_max = max(self.held_max, sum(self.in_engine.values()))
        self.held_max_by_priority[priority] = max(self.held_max_by_priority.get(priority, 0), self.in_engine[priority])

    def render(self) -> bytes:
        return generate_latest(self.registry)
