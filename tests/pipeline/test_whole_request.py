"""The end of a request, whatever ends it: its deadline, or a bug in the gateway once the stream started.

``x-request-timeout`` (else the class's ``deadline_s``) bounds the whole request, its answer
included: a stream that is still running at its deadline ends with an error event and
``[DONE]``. A bug inside the gateway after the stream started ends it the same way, never with a
connection cut mid-event. Either way every gauge the request touched returns to zero.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from gateway.pipeline.relay import SseRelay
from tests.conftest import CHAT_MODEL, KEY_ACME, metric
from tests.fake_backend import FakeBackend
from tests.servers import wait_until

HEADERS = {"authorization": f"Bearer {KEY_ACME}", "content-type": "application/json"}
STREAM = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}


def events(body: str) -> list[str]:
    return [line.removeprefix("data: ") for line in body.split("\n\n") if line.startswith("data: ")]


def test_a_stream_still_running_at_its_deadline_ends_with_an_error_event_and_done(
    gateway_url: str, backend: FakeBackend
) -> None:
    backend.gate = threading.Event()  # the backend sends its first token, then never the next
    before = metric(gateway_url, "gateway_requests_total", outcome="deadline_exceeded")
    answer = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        headers={**HEADERS, "x-request-timeout": "0.5"},
        json=STREAM,
        timeout=10,
    )
    assert answer.status_code == 200
    sent = events(answer.text)
    assert sent[-1] == "[DONE]"
    assert '"code":"deadline_exceeded"' in sent[-2]
    assert any('"content":" t0"' in event for event in sent), "the first token went through before the deadline"
    wait_until(
        lambda: metric(gateway_url, "gateway_requests_total", outcome="deadline_exceeded") == before + 1,
        what="the request counted by its outcome",
    )
    wait_until(lambda: metric(gateway_url, "gateway_backend_in_flight_requests") == 0, what="the backend slot freed")


def test_a_bug_after_the_stream_started_ends_it_with_an_error_event_and_done(
    gateway_url: str, backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    keep = SseRelay._keep
    seen = 0

    def broken_after_the_first_token(relay: SseRelay, event: bytes, t: float) -> bytes | bool:
        nonlocal seen
        seen += 1
        if seen > 2:  # the role chunk and the first token went out
            raise RuntimeError("a bug in the relay")  # stands for any bug on the request path
        return keep(relay, event, t)

    monkeypatch.setattr(SseRelay, "_keep", broken_after_the_first_token)
    before = metric(gateway_url, "gateway_requests_total", outcome="internal_error")
    answer = httpx.post(f"{gateway_url}/v1/chat/completions", headers=HEADERS, json=STREAM, timeout=10)
    monkeypatch.undo()
    assert answer.status_code == 200
    sent = events(answer.text)
    assert sent[-1] == "[DONE]"
    assert '"code":"internal_error"' in sent[-2]
    assert "a bug in the relay" not in answer.text, "no detail of the bug goes on the wire"
    wait_until(
        lambda: metric(gateway_url, "gateway_requests_total", outcome="internal_error") == before + 1,
        what="the request counted as the gateway's failure",
    )
    wait_until(lambda: metric(gateway_url, "gateway_backend_in_flight_requests") == 0, what="the backend slot freed")
