"""A real Prometheus server scrapes a running gateway and answers TTFT P99 per class.

Prometheus (Debian's package) runs on a loopback port with a temporary config and data
directory, scraping the session's gateway every second (its minimum). The test sends one
streamed request per class (acme is interactive, globex batch) and waits until Prometheus has
scraped their histograms, sends more, then polls the PromQL query until both classes have a
value, with a deadline.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

from tests.conftest import CHAT_MODEL
from tests.deploy.prometheus import Prometheus, run_prometheus
from tests.servers import admin_url, wait_until

TTFT_P99_BY_CLASS = (
    'histogram_quantile(0.99, sum by (class, le) (rate(gateway_ttft_seconds_bucket{job="gateway"}[1m])))'
)


@pytest.fixture
def prometheus(gateway_url: str, tmp_path: Path) -> Iterator[Prometheus]:
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: gateway, static_configs: [{{targets: ['{urlsplit(admin_url(gateway_url)).netloc}']}}]}}\n"
    )
    flags = [f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}", "--log.level=warn"]
    with run_prometheus(flags, tmp_path / "prometheus.log") as server:
        yield server


def stream(sdk: openai.OpenAI) -> None:
    chunks = sdk.chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True
    )
    for _ in chunks:
        pass


def p99_by_class(prometheus: Prometheus) -> dict[str, float]:
    return {
        sample["metric"].get("class", ""): float(sample["value"][1]) for sample in prometheus.query(TTFT_P99_BY_CLASS)
    }


@pytest.mark.slow
def test_prometheus_scrapes_the_gateway_and_answers_ttft_p99_per_class(
    prometheus: Prometheus, client: openai.OpenAI, globex_client: openai.OpenAI, backend: object
) -> None:
    # A histogram series appears on /metrics with its first observation, and rate() needs a sample
    # before the increase: one request per class first, scraped, then the ones the query measures.
    stream(client)  # interactive
    stream(globex_client)  # batch

    def scraped() -> bool:
        return {s["metric"].get("class") for s in prometheus.query('gateway_ttft_seconds_count{job="gateway"}')} >= {
            "interactive",
            "batch",
        }

    wait_until(scraped, timeout=30, what=f"Prometheus to scrape TTFT of both classes (log: {prometheus.log})")
    for _ in range(3):
        stream(client)
        stream(globex_client)

    def both_classes() -> bool:
        values = p99_by_class(prometheus)
        return all(not math.isnan(values.get(name, math.nan)) for name in ("interactive", "batch"))

    try:
        wait_until(both_classes, timeout=30, what="a TTFT P99 for both classes")
    except AssertionError:
        raw = prometheus.query('gateway_ttft_seconds_count{job="gateway"}')
        raise AssertionError(f"{p99_by_class(prometheus)}; counts: {raw}") from None
    values = p99_by_class(prometheus)
    assert all(0 < values[name] <= 60 for name in ("interactive", "batch")), values
