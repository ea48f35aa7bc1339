"""``Recorder.record``: every per-request latency, token and goodput metric carries the request's API.

Two finished requests, alike but for the API (dialect) they came through, must land in two label
sets of each metric, told apart by ``api`` alone, and add up to both when summed over it (as
the dashboard's per-class panels and the alerts do).
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.dialects.base import Dialect
from gateway.dialects.chat import CHAT
from gateway.dialects.responses import RESPONSES
from gateway.pipeline.outcome import RequestOutcome, Result
from gateway.pipeline.recorder import Recorder
from gateway.policy.model import Slo
from gateway.telemetry.cost_meter import CostMeter
from gateway.telemetry.labels import TenantLabels
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.token_stats import TokenStats
from gateway.telemetry.tracing import INERT_REQUEST
from tests.fake_clock import FakeClock

MODEL = "m/chat"
CLASS = "interactive"
USAGE = {"prompt_tokens": 7, "completion_tokens": 4}
GAPS = (0.01, 0.02, 0.03)  # four output chunks
SLO = Slo(ttft_ms=1000, itl_ms=100, e2e_ms=5000)

Labels = tuple[tuple[str, str], ...]


def finished(api: Dialect, *, ttft_s: float = 0.2, e2e_s: float = 0.5) -> RequestOutcome:
    """A streamed request that completed within its SLO, through ``api``."""
    arrival = 100.0
    return RequestOutcome(
        request_id=f"req-{api.name}",
        api=api,
        arrival=arrival,
        end=arrival + e2e_s,
        tenant="acme",
        model=MODEL,
        class_name=CLASS,
        stream=True,
        status=200,
        result=Result.COMPLETED,
        error=None,
        attempts=(),
        t_admit=arrival,
        tokens=TokenStats(
            arrival=arrival, first_output=arrival + ttft_s, gaps=GAPS, usage=USAGE, finish_reasons=("stop",)
        ),
        slo=SLO,
        span=INERT_REQUEST,
    )


def exposed(metrics: Metrics) -> dict[str, dict[Labels, float]]:
    """Sample name -> {sorted labels: value}, from the exposition (``le`` buckets left out)."""
    found: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            if "le" not in sample.labels and not sample.name.endswith("_created"):
                found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return found


@pytest.fixture
def metrics() -> Metrics:
    metrics = Metrics()
    clock = FakeClock()
    recorder = Recorder(metrics, CostMeter(metrics, [], clock), None, epoch_offset=0.0)
    tenants = TenantLabels(top=10, clock=clock)
    recorder.record(finished(CHAT, ttft_s=0.2, e2e_s=0.5), tenants)
    recorder.record(finished(RESPONSES, ttft_s=0.4, e2e_s=0.9), tenants)
    return metrics


def by_class(api: str) -> Labels:
    return (("api", api), ("class", CLASS), ("model", MODEL))


def by_direction(api: str, direction: str) -> Labels:
    return (("api", api), ("direction", direction), ("model", MODEL))


@pytest.mark.parametrize(
    ("sample", "chat", "responses", "value"),
    [
        ("gateway_ttft_seconds_count", by_class("chat"), by_class("responses"), 1),
        ("gateway_e2e_seconds_count", by_class("chat"), by_class("responses"), 1),
        ("gateway_itl_seconds_count", by_class("chat"), by_class("responses"), len(GAPS)),
        ("gateway_tokens_total", by_direction("chat", "input"), by_direction("responses", "input"), 7),
        ("gateway_tokens_total", by_direction("chat", "output"), by_direction("responses", "output"), 4),
        ("gateway_slo_requests_total", by_class("chat"), by_class("responses"), 1),
        ("gateway_goodput_requests_total", by_class("chat"), by_class("responses"), 1),
        ("gateway_goodput_output_tokens_total", by_class("chat"), by_class("responses"), 4),
    ],
    ids=[
        "one TTFT under each API",
        "one end-to-end latency under each API",
        "each stream's gaps under its API",
        "input tokens under each API",
        "output tokens under each API",
        "one SLO-judged request under each API",
        "one goodput request under each API",
        "goodput output tokens under each API",
    ],
)
def test_two_apis_land_in_two_label_sets(
    metrics: Metrics, sample: str, chat: Labels, responses: Labels, value: float
) -> None:
    series = exposed(metrics)[sample]
    assert series[chat] == value
    assert series[responses] == value


@pytest.mark.parametrize("histogram", ["gateway_ttft_seconds", "gateway_e2e_seconds"])
def test_each_api_keeps_its_own_latencies(metrics: Metrics, histogram: str) -> None:
    sums = exposed(metrics)[f"{histogram}_sum"]
    assert sums[by_class("chat")] < sums[by_class("responses")]


def test_summing_over_the_api_gives_the_class_what_it_had_before(metrics: Metrics) -> None:
    counts = exposed(metrics)["gateway_ttft_seconds_count"]
    assert sum(value for labels, value in counts.items() if ("class", CLASS) in labels) == 2
    requests = exposed(metrics)["gateway_requests_total"]
    assert {dict(labels)["api"] for labels in requests} == {"chat", "responses"}
