"""The operational endpoints: liveness, readiness that follows backend health, and metrics."""

from __future__ import annotations

import httpx
import openai
from openai.types.chat import ChatCompletionUserMessageParam

from tests.conftest import CHAT_MODEL, KEY_ACME, OTHER_MODEL, StartGateway, metric
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy
from tests.servers import admin_url, free_port, serve_in_thread, wait_until

USER: ChatCompletionUserMessageParam = {"role": "user", "content": "Hi"}
MODEL = {"model": CHAT_MODEL}


def test_healthz_answers_ok(gateway_url: str) -> None:
    response = httpx.get(gateway_url + "/healthz")
    assert (response.status_code, response.text) == (200, "ok")


def test_readyz_is_ready_when_every_model_has_a_healthy_backend(gateway_url: str) -> None:
    response = httpx.get(gateway_url + "/readyz")
    assert response.status_code == 200
    assert response.json() == {"ready": True, "policy_version": "test-1"}


def test_readyz_follows_the_health_of_the_backends(start_gateway: StartGateway) -> None:
    port = free_port()  # nothing listens there yet
    with start_gateway(session_policy(f"http://127.0.0.1:{port}")) as url:

        def readiness() -> int:
            return httpx.get(url + "/readyz").status_code

        response = httpx.get(url + "/readyz")
        assert response.status_code == 503
        assert sorted(response.json()["models_without_healthy_backend"]) == [CHAT_MODEL, OTHER_MODEL]
        with serve_in_thread(FakeBackend(), port=port):
            wait_until(lambda: readiness() == 200, timeout=5, what="readiness once the backend is up")
            assert metric(url, "gateway_backend_healthy", backend="fake") == 1
        wait_until(lambda: readiness() == 503, timeout=5, what="unreadiness once the backend is gone")
        assert metric(url, "gateway_backend_healthy", backend="fake") == 0


def test_requests_are_counted_by_status(gateway_url: str, http: httpx.Client, backend: FakeBackend) -> None:
    def count(status: str) -> float:
        return metric(gateway_url, "gateway_requests_total", api="chat", status=status)

    before = {status: count(status) for status in ("200", "400", "401", "404")}
    assert http.post("/v1/chat/completions", json={**MODEL, "messages": [USER]}).status_code == 200
    assert http.post("/v1/chat/completions", json={**MODEL, "messages": []}).status_code == 400
    assert http.post("/v1/chat/completions", json={"model": "nope", "messages": [USER]}).status_code == 404
    assert httpx.post(gateway_url + "/v1/chat/completions", json={}).status_code == 401
    expected = {status: value + 1 for status, value in before.items()}
    wait_until(
        lambda: {status: count(status) for status in expected} == expected,
        timeout=5,
        what=f"request counts {expected}",
    )
    assert metric(gateway_url, "gateway_requests_total", model=CHAT_MODEL, status="200", outcome="completed") >= 1


def test_a_stream_fills_the_latency_histograms_and_the_token_counters(
    gateway_url: str, client: openai.OpenAI, backend: FakeBackend
) -> None:
    labels = {"model": CHAT_MODEL, "class": "interactive"}
    names = ("gateway_ttft_seconds_count", "gateway_itl_seconds_count", "gateway_e2e_seconds_count")
    before = {name: metric(gateway_url, name, **labels) for name in names}
    tokens_before = metric(gateway_url, "gateway_tokens_total", model=CHAT_MODEL, direction="output")
    input_before = metric(gateway_url, "gateway_tokens_total", model=CHAT_MODEL, direction="input")
    backend.tokens = 5
    stream = client.chat.completions.create(model=CHAT_MODEL, messages=[USER], max_tokens=8, stream=True)
    assert len([chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.content]) == 5
    # One TTFT, four gaps between five output chunks (the role-only chunk does not count).
    expected = {
        "gateway_ttft_seconds_count": before["gateway_ttft_seconds_count"] + 1,
        "gateway_itl_seconds_count": before["gateway_itl_seconds_count"] + 4,
        "gateway_e2e_seconds_count": before["gateway_e2e_seconds_count"] + 1,
    }
    wait_until(
        lambda: {name: metric(gateway_url, name, **labels) for name in names} == expected,
        timeout=5,
        what=f"histogram counts {expected}",
    )
    assert metric(gateway_url, "gateway_ttft_seconds_sum", **labels) > 0
    assert metric(gateway_url, "gateway_tokens_total", model=CHAT_MODEL, direction="output") == tokens_before + 5
    assert metric(gateway_url, "gateway_tokens_total", model=CHAT_MODEL, direction="input") == input_before + 7


def test_a_non_streamed_answer_counts_its_usage_tokens(
    gateway_url: str, http: httpx.Client, backend: FakeBackend
) -> None:
    before = metric(gateway_url, "gateway_tokens_total", model=CHAT_MODEL, direction="output")
    backend.tokens = 3
    assert http.post("/v1/chat/completions", json={**MODEL, "messages": [USER]}).status_code == 200
    wait_until(
        lambda: metric(gateway_url, "gateway_tokens_total", model=CHAT_MODEL, direction="output") == before + 3,
        timeout=5,
        what="output tokens from the usage of a non-streamed answer",
    )


def test_metrics_are_prometheus_text_with_the_policy_version(gateway_url: str) -> None:
    response = httpx.get(admin_url(gateway_url) + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert metric(gateway_url, "gateway_policy_info", version="test-1") == 1


def test_the_model_list_requires_a_key(gateway_url: str) -> None:
    assert httpx.get(gateway_url + "/v1/models").status_code == 401
    listed = httpx.get(gateway_url + "/v1/models", headers={"authorization": f"Bearer {KEY_ACME}"}).json()
    assert listed["object"] == "list"
    assert {entry["id"] for entry in listed["data"]} == {CHAT_MODEL, OTHER_MODEL}
