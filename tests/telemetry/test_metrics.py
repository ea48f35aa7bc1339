"""``Metrics.observe_many`` writes exactly what one ``observe`` per value would (it uses
``prometheus_client`` internals to do it cheaply; this test guards them across upgrades)."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry.metrics import Metrics

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)


def test_observe_many_matches_observe() -> None:
    rng = random.Random(7)
    values = [rng.choice([0.0, 0.001, 0.01, 2.0, 5.0]) for _ in range(50)] + [rng.expovariate(50) for _ in range(500)]
    registries = [CollectorRegistry(), CollectorRegistry()]
    one_by_one, bulk = (Histogram("itl", "gaps", ["model"], buckets=BUCKETS, registry=r) for r in registries)
    for value in values:
        one_by_one.labels("m").observe(value)
    Metrics.observe_many(bulk.labels("m"), values)
    expose = [generate_latest(r).decode().splitlines() for r in registries]
    samples = [[line for line in lines if not line.startswith(("#", "itl_created"))] for lines in expose]
    assert samples[0] == samples[1]
    assert any('le="0.001"' in line and not line.endswith(" 0.0") for line in samples[1]), "boundaries count"


def test_pending_samples_reach_the_exposition_exactly_and_stay_bounded() -> None:
    metrics = Metrics()
    pending = metrics.pending
    pending.limit = 100
    for i in range(250):
        pending.inc(metrics.requests, ("m", "chat", "interactive", "200", "completed"))
        pending.observe(metrics.e2e, ("m", "chat", "interactive"), 0.01 * (i % 7))
    assert pending.size < 100, "samples are applied once the limit is reached"
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }
    request_labels = {"model": "m", "api": "chat", "class": "interactive", "status": "200", "outcome": "completed"}
    assert samples[("gateway_requests_total", tuple(sorted(request_labels.items())))] == 250
    assert samples[("gateway_e2e_seconds_count", (("api", "chat"), ("class", "interactive"), ("model", "m")))] == 250
    assert pending.size == 0
    assert not pending.counts
