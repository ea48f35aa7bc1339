"""``x-request-timeout``: the seconds a client gives its request (a number in (0, 86400]).

Anything else is the client's mistake, refused with 400 ``invalid_header`` in the OpenAI shape
before the request reaches a backend, never read as "no deadline" or as the class's default.
The official SDK never sends this header itself: its ``timeout=`` is a client-side read timeout,
which it reports as ``x-stainless-read-timeout`` (checked here against the fake backend, then
through the gateway, which ignores it). A client that wants a deadline sends the header itself
(``extra_headers``), as the load generator does.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import CHAT_MODEL, BackendServer
from tests.fake_backend import FakeBackend

MESSAGES = [{"role": "user", "content": "Hello"}]
REFUSAL = {
    "error": {
        "message": "x-request-timeout must be a number of seconds between 0 and 86400.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_header",
    }
}


def chat(http: httpx.Client, timeout_header: str, stream: bool = False) -> httpx.Response:
    body = {"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": stream}
    return http.post("/v1/chat/completions", json=body, headers={"x-request-timeout": timeout_header})


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("soon", id="a word"),
        pytest.param("", id="an empty value"),
        pytest.param("0", id="zero"),
        pytest.param("-5", id="a negative number"),
        pytest.param("86400.5", id="more than a day"),
        pytest.param("1e9", id="an exponent far past a day"),
        pytest.param("nan", id="NaN"),
        pytest.param("inf", id="infinity"),
        pytest.param("-inf", id="minus infinity"),
        pytest.param("0x10", id="a hexadecimal number"),
        pytest.param("10s", id="a number with a unit"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_an_invalid_request_timeout_is_refused_with_400_invalid_header(
    http: httpx.Client, backend: FakeBackend, value: str, stream: bool
) -> None:
    reply = chat(http, value, stream=stream)
    assert reply.status_code == 400
    assert reply.json() == REFUSAL
    assert reply.headers["content-type"].startswith("application/json")
    assert backend.received == [], "a refused request must not reach the backend"


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("30", id="whole seconds"),
        pytest.param("0.25", id="a fraction of a second"),
        pytest.param("86400", id="exactly a day"),
        pytest.param("1e3", id="an exponent"),
    ],
)
def test_a_valid_request_timeout_is_accepted(http: httpx.Client, backend: FakeBackend, value: str) -> None:
    reply = chat(http, value)
    assert reply.status_code == 200, reply.text
    assert len(backend.received) == 1


def test_the_sdk_sends_its_timeout_as_x_stainless_read_timeout_never_as_x_request_timeout(
    backend_server: BackendServer, backend: FakeBackend
) -> None:
    with openai.OpenAI(base_url=f"{backend_server.url}/v1", api_key="k", max_retries=0, timeout=7) as direct:
        direct.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    sent = backend.received[0].headers
    assert float(sent["x-stainless-read-timeout"]) == 7
    assert "x-request-timeout" not in sent


def test_the_sdk_s_own_timeout_passes_the_gateway_and_an_invalid_extra_header_raises_bad_request(
    client: openai.OpenAI, backend: FakeBackend
) -> None:
    ok = client.with_options(timeout=0.5).chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert ok.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=CHAT_MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            extra_headers={"x-request-timeout": "inf"},
        )
    assert refused.value.status_code == 400
    assert refused.value.code == "invalid_header"
    assert len(backend.received) == 1
