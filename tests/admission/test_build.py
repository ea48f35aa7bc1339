"""Field checks and policy limits: each 400 names the field and the limit; clamping rewrites.

The test policy's limits: 4 messages, 8 content parts each, 4 tools, ``n`` up to 2, and for ``test/chat`` at most 64
estimated prompt tokens and 32 output tokens (default 16); the estimate is about four
characters a token plus four per chat message.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import CHAT_MODEL, OTHER_MODEL, BackendServer, run_gateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy

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
        "at least 65 tokens",
        id="a prompt of 65 token ids is over the limit of 64",
    ),
    pytest.param(
        "/v1/completions",
        {"model": CHAT_MODEL, "prompt": [[1, 2, 3]] * 30},
        "prompt_too_long",
        "prompt",
        "at least 90 tokens",
        id="a batch of token-id prompts is bounded by its total length before it is read",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "漢字" * 40}]),
        "prompt_too_long",
        "messages",
        "about 84 tokens (estimated)",
        id="CJK text counts about a token per character, not a quarter",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "f", "description": "d" * 300}}]),
        "prompt_too_long",
        "messages",
        "accepts at most 64",
        id="tool definitions count in the prompt estimate",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(
            messages=[
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"q": "' + "x" * 300 + '"}'},
                        }
                    ],
                },
            ]
        ),
        "prompt_too_long",
        "messages",
        "accepts at most 64",
        id="an assistant's tool-call arguments count in the prompt estimate",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}] * 8}]),
        "prompt_too_long",
        "messages",
        "about 68 tokens (estimated)",  # 8 images at the test policy's 8 tokens each, plus the message's 4
        id="an image part is charged at the policy's fixed price per image",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"title": "z" * 300}}}),
        "prompt_too_long",
        "messages",
        "accepts at most 64",
        id="a response_format JSON schema counts in the prompt estimate",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 9}]),
        "too_many_content_parts",
        "messages[0].content",
        "'messages[0].content' has 9 parts; the limit is 8",
        id="a message with more content parts than the limit is refused",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "f"}}] * 5),
        "too_many_tools",
        "tools",
        "'tools' has 5 entries; the limit is 4",
        id="more tools than the limit are refused",
    ),
    pytest.param(
        "/v1/completions",
        {"model": CHAT_MODEL, "prompt": "Hi", "max_completion_tokens": 1, "max_tokens": 3000},
        "conflicting_max_tokens",
        "max_tokens",
        "'max_completion_tokens' is 1, 'max_tokens' is 3000",
        id="two output-length fields with different values are refused, naming both",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(max_tokens=8, n_predict=5000),
        "conflicting_max_tokens",
        "n_predict",
        "'n_predict' is 5000",
        id="llama.cpp's n_predict is an output-length field like the others",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(n_predict=-1),
        "invalid_field",
        "n_predict",
        "'n_predict' must be a positive integer",
        id="n_predict of -1 (llama.cpp's unbounded) is refused",
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


def test_a_model_without_a_default_max_tokens_sends_its_cap(http: httpx.Client, backend: FakeBackend) -> None:
    """Else the engine would take its own default: all of its remaining context, far above the cap."""
    response = http.post("/v1/chat/completions", json={"model": OTHER_MODEL, "messages": [USER]})
    assert response.status_code == 200
    assert backend.received[-1].body["max_tokens"] == 32


ONE_FIELD = [
    pytest.param(
        "/v1/completions",
        {"model": CHAT_MODEL, "prompt": "Hi", "max_completion_tokens": 9},
        9,
        id="a completions max_completion_tokens becomes the max_tokens vLLM reads there",
    ),
    pytest.param(
        "/v1/chat/completions",
        chat(max_completion_tokens=7, max_tokens=7),
        7,
        id="two output-length fields with the same value are one bound",
    ),
    pytest.param("/v1/chat/completions", chat(n_predict=5), 5, id="n_predict becomes max_tokens for vLLM"),
    pytest.param(
        "/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=None), 16, id="null bounds are absent"
    ),
]


@pytest.mark.parametrize(("path", "body", "bound"), ONE_FIELD)
def test_the_backend_sees_one_output_length_field_the_one_its_kind_obeys(
    http: httpx.Client, backend: FakeBackend, path: str, body: dict[str, Any], bound: int
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    received = backend.received[-1].body
    assert {k: received[k] for k in ("max_tokens", "max_completion_tokens", "n_predict") if k in received} == {
        "max_tokens": bound
    }


@pytest.fixture(scope="module")
def clamping_gateway(backend_server: BackendServer, backend_credential: str) -> Iterator[str]:
    text = session_policy(
        backend_server.url,
        limits={"max_tokens_over_limit": "clamp"},
        models={OTHER_MODEL: {"upstream_name": "org/other-v2"}},
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
    received = backend.received[-1].body
    assert received["max_tokens"] == 32  # the field a vLLM backend reads, whichever the client used
    assert "max_completion_tokens" not in received


def test_a_model_with_an_upstream_name_is_renamed_for_the_backend(clamping_gateway: str, backend: FakeBackend) -> None:
    response = httpx.post(
        clamping_gateway + "/v1/chat/completions",
        json={"model": OTHER_MODEL, "messages": [USER]},
        headers={"authorization": "Bearer key-acme"},
    )
    assert response.status_code == 200
    assert backend.received[-1].body["model"] == "org/other-v2"
