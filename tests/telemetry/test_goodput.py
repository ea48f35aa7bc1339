"""Goodput metrics: which requests are judged against their class's SLO, and which met it."""

from __future__ import annotations

import httpx

from tests.conftest import CHAT_MODEL, metric
from tests.fake_backend import FakeBackend

BODY = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hello"}]}


def test_a_fast_success_is_judged_and_counts_as_goodput(
    http: httpx.Client, gateway_url: str, backend: FakeBackend
) -> None:
    judged, good = (
        metric(gateway_url, "gateway_slo_requests_total"),
        metric(gateway_url, "gateway_goodput_requests_total"),
    )
    tokens = metric(gateway_url, "gateway_goodput_output_tokens_total")
    assert http.post("/v1/chat/completions", json={**BODY, "stream": True}).status_code == 200
    assert metric(gateway_url, "gateway_slo_requests_total") == judged + 1
    assert metric(gateway_url, "gateway_goodput_requests_total") == good + 1
    assert metric(gateway_url, "gateway_goodput_output_tokens_total") == tokens + backend.tokens


def test_a_client_error_is_not_judged_but_a_backend_failure_is_a_miss(
    http: httpx.Client, gateway_url: str, backend: FakeBackend
) -> None:
    judged, good = (
        metric(gateway_url, "gateway_slo_requests_total"),
        metric(gateway_url, "gateway_goodput_requests_total"),
    )
    assert http.post("/v1/chat/completions", json={"model": CHAT_MODEL}).status_code == 400
    assert metric(gateway_url, "gateway_slo_requests_total") == judged
    backend.status = 500
    assert http.post("/v1/chat/completions", json=BODY).status_code == 502
    assert metric(gateway_url, "gateway_slo_requests_total") == judged + 1
    assert metric(gateway_url, "gateway_goodput_requests_total") == good
    assert metric(gateway_url, "gateway_slo_objective_ratio", **{"class": "interactive"}) == 0.99
