"""Overload responses end to end: status, code, Retry-After, rate-limit headers, the SDK's retry."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer, StartGateway, metric
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy
from tests.servers import server_in_thread, wait_until

MESSAGES = [{"role": "user", "content": "Hello"}]
ONE_SLOT = {"fake": {"capacity": {"max_concurrent": 1}}}  # the backend serves one request at a time
LONG_WAIT = {"interactive": {"queue": {"max_wait_s": 30}}}
NO_QUEUE = {"interactive": {"queue": {"max_depth": 0, "max_wait_s": 5}}}


@pytest.fixture
def backend_server_url(backend_server: BackendServer) -> str:
    return backend_server.url


def release(backend: FakeBackend, gate: threading.Event) -> None:
    """Let the held stream run to its end (the fake closes the gate after every chunk)."""
    backend.gate = None
    gate.set()


def hold_one_stream(url: str, backend: FakeBackend) -> tuple[threading.Thread, threading.Event]:
    """Start a stream that stays in flight until ``release``."""
    gate = threading.Event()
    backend.gate = gate
    backend.tokens = 3
    first_chunk = threading.Event()

    def run() -> None:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=30) as sdk:
            for _ in sdk.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, stream=True):  # type: ignore[arg-type]
                first_chunk.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert first_chunk.wait(10), "the held stream never started"
    return thread, gate


@pytest.mark.parametrize(
    ("sections", "status", "code"),
    [
        pytest.param(
            {"tenants": {"acme": {"limits": {"max_concurrent": 1}}}},
            429,
            "tenant_concurrency_limited",
            id="a tenant over its concurrency limit gets 429 and the SDK retries after Retry-After",
        ),
        pytest.param(
            {"backends": ONE_SLOT, "classes": NO_QUEUE},
            503,
            "queue_full",
            id="a full queue gets 503 and the SDK retries after Retry-After",
        ),
    ],
)
def test_the_sdk_honours_retry_after(
    start_gateway: StartGateway,
    backend: FakeBackend,
    backend_server_url: str,
    sections: dict[str, Any],
    status: int,
    code: str,
) -> None:
    with start_gateway(session_policy(backend_server_url, **sections), health_checks=False) as url:
        held, gate = hold_one_stream(url, backend)
        raw = httpx.post(
            f"{url}/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY_ACME}"},
            json={"model": CHAT_MODEL, "messages": MESSAGES},
        )
        assert raw.status_code == status
        assert raw.json()["error"]["code"] == code
        assert raw.headers["retry-after"] == "1"
        assert 0 < int(raw.headers["retry-after-ms"]) <= 1000
        assert ("concurrency limit" if status == 429 else "queue") in raw.json()["error"]["message"]

        result: dict[str, object] = {}

        def retrying_call() -> None:
            with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=2, timeout=30) as sdk:
                start = time.monotonic()
                reply = sdk.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES)  # type: ignore[arg-type]
            result["content"], result["elapsed"] = reply.choices[0].message.content, time.monotonic() - start

        caller = threading.Thread(target=retrying_call)
        caller.start()
        wait_until(lambda: metric(url, "gateway_rejections_total", reason=code) >= 2, what="the SDK's first try")
        release(backend, gate)
        caller.join(30)
        held.join(10)
        assert result.get("content"), "the SDK's retry did not succeed"
        assert float(result["elapsed"]) >= 0.9  # type: ignore[arg-type]
        assert metric(url, "gateway_rejections_total", reason=code, tenant="acme") == 2


def test_every_response_carries_the_rate_limit_headers(http: httpx.Client, backend: FakeBackend) -> None:
    response = http.post("/v1/chat/completions", json={"model": CHAT_MODEL, "messages": MESSAGES})
    assert response.status_code == 200
    assert response.headers["x-ratelimit-limit-requests"] == "6000"
    assert int(response.headers["x-ratelimit-remaining-requests"]) < 6000
    assert response.headers["x-ratelimit-limit-tokens"] == "20000000"
    assert response.headers["x-ratelimit-reset-requests"].endswith(("ms", "s"))


def test_a_lowered_priority_reaches_an_engine_that_schedules_by_it(
    start_gateway: StartGateway, backend: FakeBackend, backend_server_url: str
) -> None:
    text = session_policy(backend_server_url, backends={"fake": {"engine_priority": True}})
    with start_gateway(text, health_checks=False) as url:
        headers = {"authorization": f"Bearer {KEY_ACME}"}
        httpx.post(f"{url}/v1/chat/completions", headers=headers, json={"model": CHAT_MODEL, "messages": MESSAGES})
        httpx.post(
            f"{url}/v1/chat/completions",
            headers={**headers, "x-priority": "batch"},
            json={"model": CHAT_MODEL, "messages": MESSAGES},
        )
        assert [r.body.get("priority") for r in backend.received] == [0, 1]
        assert metric(url, "gateway_requests_total", **{"class": "batch"}) == 1


def test_a_client_that_leaves_the_queue_frees_its_place_at_once(
    start_gateway: StartGateway, backend: FakeBackend, backend_server_url: str
) -> None:
    text = session_policy(backend_server_url, backends=ONE_SLOT, classes=LONG_WAIT)
    with start_gateway(text, health_checks=False) as url:
        held, gate = hold_one_stream(url, backend)
        with httpx.Client(timeout=0.5) as impatient, pytest.raises(httpx.ReadTimeout):
            impatient.post(
                f"{url}/v1/chat/completions",
                headers={"authorization": f"Bearer {KEY_ACME}"},
                json={"model": CHAT_MODEL, "messages": MESSAGES},
            )
        wait_until(lambda: metric(url, "gateway_queue_depth") == 0, what="the queue to empty")
        assert metric(url, "gateway_requests_total", outcome="client_disconnected") == 1
        release(backend, gate)
        held.join(10)
        wait_until(lambda: metric(url, "gateway_backend_in_flight_requests") == 0, what="in-flight back to zero")
        assert len(backend.received) == 1, "the request that left while queued must never reach the backend"


def test_tenants_beyond_the_busiest_are_counted_as_other(
    start_gateway: StartGateway, backend: FakeBackend, backend_server_url: str
) -> None:
    text = session_policy(backend_server_url, tenants={"acme": {"limits": {"rpm": 1}}}, telemetry={"top_tenants": 0})
    with start_gateway(text, health_checks=False) as url:
        headers = {"authorization": f"Bearer {KEY_ACME}"}
        for _ in range(2):
            httpx.post(f"{url}/v1/chat/completions", headers=headers, json={"model": CHAT_MODEL, "messages": MESSAGES})
        assert metric(url, "gateway_rejections_total", tenant="other") == 1
        assert metric(url, "gateway_rejections_total", tenant="acme") == 0


AT_REST = (
    "gateway_backend_in_flight_requests",
    "gateway_backend_in_flight_tokens",
    "gateway_class_in_flight_requests",
    "gateway_queue_depth",
)


def test_requests_queued_when_every_backend_dies_end_at_once_with_no_healthy_backend(
    start_gateway: StartGateway,
) -> None:
    """The one backend stops listening while one stream runs on it and three requests wait for
    it: the health check marks it down and each waiting request gets 503 ``no_healthy_backend``
    then, not 30 s later at its queue timeout; the stream in flight still finishes."""
    dying = FakeBackend()
    with (
        server_in_thread(dying) as server,
        start_gateway(session_policy(server.url, backends=ONE_SLOT, classes=LONG_WAIT)) as url,
    ):
        held, gate = hold_one_stream(url, dying)
        headers = {"authorization": f"Bearer {KEY_ACME}"}
        body = {"model": CHAT_MODEL, "messages": MESSAGES}
        with ThreadPoolExecutor(3) as pool:
            queued = [
                pool.submit(httpx.post, f"{url}/v1/chat/completions", headers=headers, json=body, timeout=60)
                for _ in range(3)
            ]
            wait_until(lambda: metric(url, "gateway_queue_depth") == 3, what="three requests in the queue")
            t_dead = time.monotonic()
            server.stop_listening()
            replies = [future.result(timeout=60) for future in queued]
            ended_within_s = time.monotonic() - t_dead
        assert metric(url, "gateway_backend_healthy", backend="fake") == 0
        for reply in replies:
            assert reply.status_code == 503, reply.text
            assert reply.json() == {
                "error": {
                    "message": "No healthy backend serves this model right now (all down or their breakers open).",
                    "type": "server_error",
                    "param": None,
                    "code": "no_healthy_backend",
                }
            }
            assert reply.headers["retry-after"] == "1"
        assert ended_within_s < 10, f"{ended_within_s:.1f}s: the queue's timeout (30 s), not the backend's death"
        release(dying, gate)
        held.join(10)
        assert not held.is_alive(), "the stream in flight on the dying backend did not finish"
        assert len(dying.received) == 1, "no queued request may have reached the dying backend"
        wait_until(lambda: all(metric(url, name) == 0 for name in AT_REST), what="every gauge back to 0")
        late = httpx.post(f"{url}/v1/chat/completions", headers=headers, json=body, timeout=10)
        assert (late.status_code, late.json()["error"]["code"]) == (503, "no_healthy_backend")
