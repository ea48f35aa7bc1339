"""Field checks and policy limits: each 400 names the field and the limit; clamping rewrites.

The test policy's limits: 4 messages, ``n`` up to 2, and for ``test/chat`` at most 64
estimated prompt tokens and 32 output tokens (default 16); the estimate is about four
characters a token plus four per chat message.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import CHAT_MODEL, OTHER_MODEL, BackendServer, policy_text, run_gateway
from tests.fake_backend import FakeBackend

USER = {"role": "user", "content": "Hi"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": CHAT_MODEL, "messages": [USER], **fields}


LONG_TEXT = "x" * 400  # about 100 tokens, over the model's 64

INVALID_REQUESTS = [
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": LONG_TEXT}]),
        "prompt_too_long",
        "messages",
        "about 104 tokens (estimated); model 'test/chat' accepts at most 64",
        id="a chat prompt over the model's estimated token limit is refused",
    ),
    pytest.param(
        "/v1/completions",
        {"model": CHAT_MODEL, "prompt": LONG_TEXT},
        "prompt_too_long",
        "prompt",
        "about 100 tokens (estimated); model 'test/chat' accepts at most 64",
        id="a completions prompt over the token limit is refused",
    ),
    pytest.param(
        "/v1/completions",
        {"model": CHAT_MODEL, "prompt": list(range(65))},
        "prompt_too_long",
        "prompt",
        "about 65 tokens",
        id="a prompt of 65 token ids is over the limit of 64",
    ),
    pytest.param(
        "/v1/embeddings",
        {"model": CHAT_MODEL, "input": [LONG_TEXT]},
        "prompt_too_long",
        "input",
        "accepts at most 64",
        id="an embeddings input over the token limit is refused",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[USER] * 5),
        "too_many_messages",
        "messages",
        "'messages' has 5 entries; the limit is 4",
        id="five messages are over the limit of four",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(max_tokens=33),
        "max_tokens_too_large",
        "max_tokens",
        "'max_tokens' is 33; model 'test/chat' allows at most 32",
        id="max_tokens one over the model's cap is refused in reject mode",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(max_completion_tokens=1000),
        "max_tokens_too_large",
        "max_completion_tokens",
        "'max_completion_tokens' is 1000; model 'test/chat' allows at most 32",
        id="max_completion_tokens over the cap is refused in reject mode",
    ),
    pytest.param(
        "/v1/completions",
        {"model": CHAT_MODEL, "prompt": "Hi", "max_tokens": 100},
        "max_tokens_too_large",
        "max_tokens",
        "allows at most 32",
        id="a completions max_tokens over the cap is refused",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(n=3),
        "n_too_large",
        "n",
        "'n' is 3; the limit is 2",
        id="n over the policy's cap is refused",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(n=0),
        "invalid_field",
        "n",
        "'n' must be a positive integer",
        id="n of zero is refused",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(max_tokens="8"),
        "invalid_field",
        "max_tokens",
        "must be a positive integer",
        id="max_tokens as a string is refused",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(stream="true"),
        "invalid_field",
        "stream",
        "'stream' must be a boolean",
        id="stream as a string is refused",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(messages="Hi"),
        "invalid_field",
        "messages",
        "must be a non-empty array",
        id="messages as a string is refused",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[{"role": "wizard", "content": "Hi"}]),
        "invalid_field",
        "messages[0].role",
        "'messages[0].role' must be one of",
        id="an unknown role is refused",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[USER, {"role": "user", "content": {"text": "Hi"}}]),
        "invalid_field",
        "messages[1].content",
        "'messages[1].content' must be a string or an array of parts",
        id="an object as message content is refused",
    ),
    pytest.param(
        "/v1/chat/completions",
        {"messages": [USER]},
        "invalid_field",
        "model",
        "'model' is required",
        id="a request without a model is refused",
    ),
    pytest.param(
        "/v1/completions",
        {"model": CHAT_MODEL},
        "invalid_field",
        "prompt",
        "'prompt' is required",
        id="a completion without a prompt is refused",
    ),
    pytest.param(
        "/v1/embeddings",
        {"model": CHAT_MODEL, "input": [1, "a"]},
        "invalid_field",
        "input",
        "'input' is required: a string, a list of strings, or token ids",
        id="an embeddings input mixing ids and text is refused",
    ),
    pytest.param(
        "/v1/embeddings",
        {"model": CHAT_MODEL, "input": "Hi", "stream": True},
        "invalid_field",
        "stream",
        "Embeddings cannot be streamed",
        id="a streamed embeddings request is refused",
    ),
]


@pytest.mark.parametrize(("path", "body", "code", "param", "message"), INVALID_REQUESTS)
def test_an_invalid_request_is_a_400_naming_the_field_and_the_limit(
    http: httpx.Client, backend: FakeBackend, path: str, body: dict[str, Any], code: str, param: str, message: str
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error == {"message": error["message"], "type": "invalid_request_error", "param": param, "code": code}
    assert message in error["message"]
    assert backend.received == []


ACCEPTED = [
    pytest.param(chat(max_tokens=32), {"max_tokens": 32}, id="max_tokens at the cap is forwarded unchanged"),
    pytest.param(chat(), {"max_tokens": 16}, id="a missing max_tokens gets the model's default"),
    pytest.param(chat(max_tokens=8, n=2), {"max_tokens": 8, "n": 2}, id="n at the cap is forwarded"),
    pytest.param(chat(messages=[USER] * 4), {"max_tokens": 16}, id="four messages are at the limit"),
    pytest.param(
        chat(messages=[{"role": "user", "content": "x" * 240}]),
        {"max_tokens": 16},
        id="a prompt of 64 estimated tokens is at the limit",
    ),
    pytest.param(
        chat(max_tokens=8, temperature=0.5, logit_bias={"1": 2}),
        {"temperature": 0.5, "logit_bias": {"1": 2}},
        id="fields the gateway does not act on pass through untouched",
    ),
]


@pytest.mark.parametrize(("body", "forwarded"), ACCEPTED)
def test_a_request_within_the_limits_reaches_the_backend(
    http: httpx.Client, backend: FakeBackend, body: dict[str, Any], forwarded: dict[str, Any]
) -> None:
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    received = backend.received[-1].body
    assert {key: received.get(key) for key in forwarded} == forwarded
    assert received["messages"] == body["messages"]


def test_a_model_without_a_default_max_tokens_gets_none_added(http: httpx.Client, backend: FakeBackend) -> None:
    response = http.post("/v1/chat/completions", json={"model": OTHER_MODEL, "messages": [USER]})
    assert response.status_code == 200
    assert "max_tokens" not in backend.received[-1].body


@pytest.fixture(scope="module")
def clamping_gateway(backend_server: BackendServer, backend_credential: str) -> Iterator[str]:
    text = policy_text(
        backend_server.url,
        **{
            "max_tokens_over_limit: reject": "max_tokens_over_limit: clamp",
            "  - name: test/other\n": "  - name: test/other\n    upstream_name: org/other-v2\n",
        },
    )
    with run_gateway(text) as url:
        yield url


CLAMPED = [
    pytest.param("/v1/chat/completions", chat(max_tokens=1000), "max_tokens", id="max_tokens over the cap is clamped"),
    pytest.param(
        "/v1/chat/completions",
        chat(max_completion_tokens=33),
        "max_completion_tokens",
        id="max_completion_tokens over the cap is clamped",
    ),
    pytest.param(
        "/v1/completions",
        {"model": CHAT_MODEL, "prompt": "Hi", "max_tokens": 10**9},
        "max_tokens",
        id="a completions max_tokens of a billion is clamped",
    ),
]


@pytest.mark.parametrize(("path", "body", "field"), CLAMPED)
def test_in_clamp_mode_the_backend_receives_the_capped_value(
    clamping_gateway: str, backend: FakeBackend, path: str, body: dict[str, Any], field: str
) -> None:
    response = httpx.post(clamping_gateway + path, json=body, headers={"authorization": "Bearer key-acme"})
    assert response.status_code == 200, response.text
    assert backend.received[-1].body[field] == 32


def test_a_model_with_an_upstream_name_is_renamed_for_the_backend(clamping_gateway: str, backend: FakeBackend) -> None:
    response = httpx.post(
        clamping_gateway + "/v1/chat/completions",
        json={"model": OTHER_MODEL, "messages": [USER]},
        headers={"authorization": "Bearer key-acme"},
    )
    assert response.status_code == 200
    assert backend.received[-1].body["model"] == "org/other-v2"
