"""The engine's request id: the gateway's, fresh for every attempt, never the client's.

vLLM takes the incoming ``x-request-id`` as its own request id, and duplicate ids have crashed
some of its versions; so each attempt (a retry, a migrated stream) sends ``gw-`` + random hex,
the client keeps its own id, and the gateway writes both together (a debug line per attempt,
the warning line of a failure, the attempt's trace span). The fake backend records the id it
got on every request.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.upstream.client import new_engine_request_id
from loadtests.harness.otlp_sink import OtlpSink
from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer, StartGateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy, traces_to
from tests.servers import serve_in_thread, wait_until

ENGINE_ID = re.compile(r"gw-[0-9a-f]{24}")
RETRYING = {"max_retries": 2, "budget_min_per_s": 100, "backoff_base_s": 0.01}
MESSAGES = [{"role": "user", "content": "Hi"}]


def engine_ids(backend: FakeBackend) -> list[str]:
    return [r.headers["x-request-id"] for r in backend.received if r.path.startswith("/v1/")]


def test_each_engine_id_is_fresh_and_shaped_alike() -> None:
    ids = {new_engine_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(ENGINE_ID.fullmatch(i) for i in ids)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_the_engine_gets_the_gateway_s_id_and_the_client_keeps_its_own(
    http: httpx.Client, backend: FakeBackend, stream: bool
) -> None:
    body = {"model": CHAT_MODEL, "messages": MESSAGES, "stream": stream}
    first = http.post("/v1/chat/completions", json=body, headers={"x-request-id": "client-id-1"})
    second = http.post("/v1/chat/completions", json=body, headers={"x-request-id": "client-id-1"})
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "client-id-1"
    seen = engine_ids(backend)
    assert len(seen) == 2
    assert all(ENGINE_ID.fullmatch(i) for i in seen), seen
    assert seen[0] != seen[1], "one client id sent twice is two engine requests"


def test_each_attempt_of_a_retried_request_gives_the_engine_a_new_id_and_logs_both(
    start_gateway: StartGateway, backend_server: BackendServer, backend: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    backend.statuses = [503, 502]  # two failed attempts, then the answer
    with (
        caplog.at_level(logging.DEBUG, logger="gateway.upstream.client"),
        start_gateway(session_policy(backend_server.url, retry=RETRYING), health_checks=False) as url,
    ):
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": CHAT_MODEL, "messages": MESSAGES},
            headers={"authorization": f"Bearer {KEY_ACME}", "x-request-id": "client-retried-1"},
        )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "client-retried-1"
    seen = engine_ids(backend)
    assert len(seen) == 3
    assert len(set(seen)) == 3, "every attempt is a new engine request"
    assert "client-retried-1" not in seen
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.upstream.client"]
    for engine_id in seen:
        assert any("client-retried-1" in line and engine_id in line for line in lines), f"{engine_id} not logged"


def test_a_migrated_stream_gives_the_engine_a_new_id_for_its_continuation(
    start_gateway: StartGateway, backend_server: BackendServer, backend: FakeBackend
) -> None:
    backend.tokens, backend.cut_after = 4, 1  # every attempt breaks after one token
    with start_gateway(session_policy(backend_server.url, retry=RETRYING), health_checks=False) as url:
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": CHAT_MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 8},
            headers={"authorization": f"Bearer {KEY_ACME}", "x-request-id": "client-migrated-1"},
        )
    assert response.status_code == 200
    seen = engine_ids(backend)
    assert len(seen) == 3, "the first attempt and two continuations"
    assert len(set(seen)) == 3
    assert "client-migrated-1" not in seen
    assert backend.received[1].body.get("continue_final_message") is True, "the second attempt was a continuation"


@pytest.fixture
def sink() -> Iterator[tuple[OtlpSink, str]]:
    receiver = OtlpSink(keep=True)
    with serve_in_thread(receiver) as url:
        yield receiver, url


def test_the_attempt_span_names_the_engine_id_and_what_the_backend_said(
    sink: tuple[OtlpSink, str], backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway
) -> None:
    receiver, sink_url = sink
    backend.status = 400
    backend.error_body = b'{"error": {"message": "too long for http://10.0.0.7/x", "code": 400}}'
    with start_gateway(session_policy(backend_server.url, telemetry=traces_to(sink_url))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY_ACME, max_retries=0)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}])
        wait_until(lambda: any(s.name.startswith("upstream ") for s in receiver.snapshot()), what="the attempt span")
    attempt = next(s for s in receiver.snapshot() if s.name.startswith("upstream "))
    assert attempt.attributes["gateway.engine_request_id"] == engine_ids(backend)[-1]
    assert attempt.attributes["gateway.upstream.client.status"] == 400
    assert attempt.attributes["gateway.upstream.client.error_excerpt"] == "too long for [url]"
