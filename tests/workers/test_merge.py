"""One exposition for the set (``gateway/workers/merge.py``), from real gateways' /metrics pages."""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry.metrics import Metrics
from gateway.workers.merge import merge_families, parse_pages, supervisor_families
from tests.deploy.conftest import binary


def page(requests: int) -> str:
    """A gateway's /metrics after ``requests`` requests, with a histogram observed."""
    metrics = Metrics()
    for _ in range(requests):
        metrics.requests.labels("test/chat", "chat", "interactive", "200", "completed").inc()
    metrics.ttft.labels("test/chat", "chat", "interactive").observe(0.2)
    return metrics.exposition().decode()


def merged(pages: dict[int, str]) -> str:
    parsed = parse_pages(pages)
    up = [index in parsed for index in range(len(pages))]
    own = supervisor_families(len(pages), [True] * len(pages), [0, 3][: len(pages)], up)
    return merge_families(parsed, own).decode()


def test_every_sample_keeps_its_value_and_gains_its_workers_label() -> None:
    text = merged({0: page(2), 1: page(5)})
    requests = {
        s.labels["worker"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "gateway_requests"
        for s in f.samples
        if s.name == "gateway_requests_total"
    }
    assert requests == {"0": 2.0, "1": 5.0}
    buckets = [s for f in text_string_to_metric_families(text) if f.name == "gateway_ttft_seconds" for s in f.samples]
    assert {s.labels["worker"] for s in buckets} == {"0", "1"}
    assert all("le" in s.labels for s in buckets if s.name.endswith("_bucket"))


def test_each_family_appears_once_with_one_help_and_one_type() -> None:
    text = merged({0: page(1), 1: page(1)})
    single = page(1)
    for kind in ("# HELP ", "# TYPE "):
        lines = [line.split()[2] for line in text.splitlines() if line.startswith(kind)]
        assert len(lines) == len(set(lines))
        assert {line.split()[2] for line in single.splitlines() if line.startswith(kind)} <= set(lines)


def test_promtool_accepts_the_merged_exposition() -> None:
    checked = subprocess.run(
        [binary("promtool"), "check", "metrics"],
        input=merged({0: page(1), 1: page(3)}),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    ("pages", "up"),
    [
        pytest.param(
            {0: "gateway_x{ 1\n", 1: page(1)}, {"0": 0.0, "1": 1.0}, id="a page that does not parse is left out"
        ),
        pytest.param({1: page(1)}, {"0": 0.0, "1": 1.0}, id="a worker that did not answer is down"),
    ],
)
def test_a_worker_whose_page_is_missing_is_shown_down(pages: dict[int, str], up: dict[str, float]) -> None:
    parsed = parse_pages(pages)
    own = supervisor_families(2, [True, True], [0, 1], [i in parsed for i in range(2)])
    families = {f.name: f for f in text_string_to_metric_families(merge_families(parsed, own).decode())}
    assert {s.labels["worker"]: s.value for s in families["gateway_worker_up"].samples} == up
    assert {s.labels["worker"] for s in families["gateway_requests"].samples} == {"1"}
    assert families["gateway_workers_alive"].samples[0].value == 2
    restarts = {s.labels["worker"]: s.value for s in families["gateway_worker_restarts"].samples}
    assert restarts == {"0": 0.0, "1": 1.0}
