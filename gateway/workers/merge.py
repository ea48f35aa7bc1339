"""One Prometheus exposition for a set of workers: every worker's samples, labelled by worker.

The rule: each sample keeps its name, labels and value, and gains ``worker="<index>"``; each
family appears once (its HELP and TYPE from the first worker that has it, its samples from all,
in worker order), then the supervisor's own families. Nothing is summed here. Why not: a
worker that restarts starts its counters from zero, and a sum over workers would then go
down, which Prometheus reads as a reset of the whole counter (``rate`` would count every other
worker's total again). Per-worker series reset on their own, ``rate`` handles each, and
``sum without (worker) (rate(...))`` is the set's rate; histograms' buckets add up the same way.
Gauges that are per process (in-flight requests, queue depths) add up too; those that copy the
policy (``gateway_slo_objective_ratio``, ``gateway_queue_capacity``) are the same in every
worker (take ``max without (worker)``).

A worker that did not answer in time (or whose page did not parse) has no samples in that scrape, and
``gateway_worker_up{worker}`` is 0 for it (as Prometheus's own ``up`` for a target).

The pages are parsed and rendered with ``prometheus_client`` (its parser and
``generate_latest``), so escaping, counters' ``_total`` and ``_created`` and histograms' ``le``
come out exactly as a single gateway writes them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

WORKER_LABEL = "worker"


def parse_pages(pages: Mapping[int, str]) -> dict[int, list[Metric]]:
    """Each worker's page (index to its /metrics text) as families; one that does not parse is
    left out (logged), as if that worker had not answered."""
    parsed = {}
    for index, text in pages.items():
        try:
            parsed[index] = list(text_string_to_metric_families(text))
        except ValueError as exc:
            log.error("worker %d's /metrics does not parse, left out: %s", index, exc)
    return parsed


def merge_families(parsed: Mapping[int, Sequence[Metric]], own: Iterable[Metric] = ()) -> bytes:
    """Every family of ``parsed`` once, each sample with its worker's label, then ``own``, in the
    text format (see the module docstring)."""
    families: dict[str, Metric] = {}
    for index in sorted(parsed):
        worker = str(index)
        for family in parsed[index]:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                labels = {**sample.labels, WORKER_LABEL: worker}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families.values(), *own]))
    return generate_latest(registry)


def supervisor_families(
    workers: int, alive: Sequence[bool], restarts: Sequence[int], up: Sequence[bool]
) -> list[Metric]:
    """The supervisor's own: live workers, restarts and whether each one's page was merged."""
    alive_family = GaugeMetricFamily(
        "gateway_workers_alive", f"Worker processes running, of the {workers} configured.", value=sum(alive)
    )
    restarts_family = CounterMetricFamily(
        "gateway_worker_restarts", "Times the supervisor restarted a worker that exited.", labels=[WORKER_LABEL]
    )
    up_family = GaugeMetricFamily(
        "gateway_worker_up",
        "1 when the worker's metrics are in this scrape, 0 when it did not answer.",
        labels=[WORKER_LABEL],
    )
    for index in range(workers):
        restarts_family.add_metric([str(index)], restarts[index])
        up_family.add_metric([str(index)], 1.0 if up[index] else 0.0)
    return [alive_family, restarts_family, up_family]


class _Fixed(Collector):
    """A collector of families already built (one scrape's)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families
