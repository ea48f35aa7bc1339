"""Body fields: the per-API allowlist, the fields only the gateway sets, and the policy's extension.

Clients are the official SDK (extras through ``extra_body=``, as users send them) and raw httpx;
what reached the engine is read from the fake backend's record of received bodies.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.policy.loader import PolicyError
from gateway.service import parse_policy
from tests.conftest import CHAT_MODEL, KEY_ACME, KEY_GLOBEX, BackendServer, StartGateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy

SECRET = "fields-salt-secret"
MESSAGES: list[Any] = [{"role": "user", "content": "Hi"}]


def chat(client: openai.OpenAI, **extra_body: Any) -> None:
    client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra_body)


def sdk_for(url: str, key: str = KEY_ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)


def refusal(excinfo: pytest.ExceptionInfo[openai.BadRequestError]) -> dict[str, Any]:
    body = excinfo.value.body
    assert isinstance(body, dict)
    return body


# --- what passes, what is refused -----------------------------------------------------------

ALLOWED_EXTRAS = [
    pytest.param({"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}, id="vLLM sampling extras"),
    pytest.param({"guided_json": {"type": "object"}}, id="vLLM's older structured output"),
    pytest.param({"structured_outputs": {"regex": "[a-z]+"}}, id="vLLM's structured outputs"),
    pytest.param({"chat_template_kwargs": {"enable_thinking": False}}, id="a chat template switch"),
    pytest.param({"chat_template_kwargs": {"builtin_tools": ["code_interpreter"]}}, id="a short list as a switch"),
    pytest.param({"ebnf": "root ::= 'a'", "no_stop_trim": True}, id="SGLang extras"),
    pytest.param({"mirostat": 2, "typical_p": 0.9}, id="llama.cpp samplers"),
    pytest.param({"continue_final_message": True, "add_generation_prompt": False}, id="prefill switches"),
]


@pytest.mark.parametrize("extra", ALLOWED_EXTRAS)
def test_safe_engine_extras_reach_the_backend_unchanged(
    client: openai.OpenAI, backend: FakeBackend, extra: dict[str, Any]
) -> None:
    chat(client, **extra)
    received = backend.received[-1].body
    assert {name: received.get(name) for name in extra} == extra


REFUSED_FIELDS = [
    pytest.param({"kv_transfer_params": {"remote_host": "10.0.0.9"}}, "kv_transfer_params", id="KV transfer"),
    pytest.param({"vllm_xargs": {"x": 1}}, "vllm_xargs", id="vLLM extension args"),
    pytest.param({"data_parallel_rank": 0}, "data_parallel_rank", id="a data-parallel rank"),
    pytest.param({"chat_template": "{{ messages }}"}, "chat_template", id="a request's own template"),
    pytest.param({"id_slot": 0}, "id_slot", id="a llama.cpp slot"),
    pytest.param({"lora_path": "/models/other"}, "lora_path", id="an adapter by path"),
    pytest.param({"bootstrap_host": "10.0.0.9"}, "bootstrap_host", id="a prefill server"),
]


@pytest.mark.parametrize(("extra", "name"), REFUSED_FIELDS)
def test_fields_that_steer_the_engine_are_refused_and_never_reach_it(
    client: openai.OpenAI, backend: FakeBackend, extra: dict[str, Any], name: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, **extra)
    error = refusal(refused)
    assert (error["code"], error["param"]) == ("unsupported_field", name)
    assert "set by the gateway" in error["message"]
    assert backend.received == []


UNKNOWN_FIELDS = [
    pytest.param("/v1/chat/completions", {"messages": MESSAGES, "temprature": 0.5}, "temprature", id="a typo"),
    pytest.param(
        "/v1/chat/completions",
        {"messages": MESSAGES, "mm_processor_kwargs": {}},
        "mm_processor_kwargs",
        id="an engine knob outside the default list",
    ),
    pytest.param(
        "/v1/chat/completions",
        {"messages": MESSAGES, "documents": [{"text": "x"}]},
        "documents",
        id="text outside messages",
    ),
    pytest.param(
        "/v1/completions", {"prompt": "Hi", "messages": MESSAGES}, "messages", id="chat's field in completions"
    ),
    pytest.param("/v1/completions", {"prompt": "Hi", "best_of": 20}, "best_of", id="best_of, which escapes the n cap"),
    pytest.param("/v1/embeddings", {"input": "Hi", "temperature": 0.5}, "temperature", id="sampling in embeddings"),
    pytest.param(
        "/v1/chat/completions",
        {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True, "chunk_size": 4}},
        "stream_options.chunk_size",
        id="an unknown stream option",
    ),
    pytest.param("/v1/chat/completions", {"messages": MESSAGES, "x" * 500: 1}, "x" * 64 + "...", id="a huge name"),
]


@pytest.mark.parametrize(("path", "fields", "param"), UNKNOWN_FIELDS)
def test_an_unknown_field_is_refused_as_openai_does(
    http: httpx.Client, backend: FakeBackend, path: str, fields: dict[str, Any], param: str
) -> None:
    response = http.post(path, json={"model": CHAT_MODEL, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_field", param)
    assert error["message"] == f"Unrecognized request argument supplied: {param}"
    assert backend.received == []


PER_API_FIELDS = [
    pytest.param("/v1/completions", {"prompt": "Hi", "suffix": "!", "echo": True, "top_k": 5}, id="completions extras"),
    pytest.param(
        "/v1/embeddings",
        {"input": "Hi", "encoding_format": "float", "dimensions": 8, "truncate_prompt_tokens": 16},
        id="embeddings fields",
    ),
    pytest.param(
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        id="both stream options",
    ),
]


@pytest.mark.parametrize(("path", "fields"), PER_API_FIELDS)
def test_each_api_takes_its_own_fields(
    http: httpx.Client, backend: FakeBackend, path: str, fields: dict[str, Any]
) -> None:
    response = http.post(path, json={"model": CHAT_MODEL, **fields})
    assert response.status_code == 200, response.text
    received = backend.received[-1].body
    assert all(name in received for name in fields)


TEMPLATE_KWARGS = [
    pytest.param({"chat_template": "{{ 'pwned' }}"}, "unsupported_field", id="a template smuggled in the kwargs"),
    pytest.param({"messages": []}, "unsupported_field", id="messages that would replace the estimated ones"),
    pytest.param({"add_generation_prompt": False}, "unsupported_field", id="a renderer switch with a field of its own"),
    pytest.param({"context": "x" * 300}, "invalid_field", id="content rather than a switch"),
    pytest.param({"options": {"deep": True}}, "invalid_field", id="an object rather than a switch"),
    pytest.param({"tags": ["a"] * 17}, "invalid_field", id="a list of seventeen"),
]


@pytest.mark.parametrize(("kwargs", "code"), TEMPLATE_KWARGS)
def test_chat_template_kwargs_are_switches_never_templates_or_content(
    client: openai.OpenAI, backend: FakeBackend, kwargs: dict[str, Any], code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, chat_template_kwargs=kwargs)
    error = refusal(refused)
    assert error["code"] == code
    assert error["param"] == f"chat_template_kwargs.{next(iter(kwargs))}"
    assert backend.received == []


# --- fields the gateway sets itself ---------------------------------------------------------


def expected_salt(scope: str) -> str:
    return hmac.new(SECRET.encode(), scope.encode(), hashlib.sha256).hexdigest()[:32]


@pytest.fixture
def priority_gateway(
    start_gateway: StartGateway, backend: FakeBackend, backend_server: BackendServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """vLLM backend scheduling by priority, with a known cache-salt secret."""
    monkeypatch.setenv("GATEWAY_CACHE_SALT_SECRET", SECRET)
    text = session_policy(backend_server.url, backends={"fake": {"engine_priority": True}})
    with start_gateway(text, health_checks=False) as url:
        yield url


OWNED = {"priority": -100, "cache_salt": "guess", "request_id": "mine", "service_tier": "priority"}


@pytest.mark.parametrize(
    ("key", "rank", "scope"),
    [
        pytest.param(KEY_ACME, 0, "tenant:acme", id="an interactive tenant gets its class and its salt"),
        pytest.param(KEY_GLOBEX, 1, "tenant:globex", id="a batch tenant asking for -100 still runs as batch"),
    ],
)
def test_a_clients_priority_and_salt_are_replaced_by_the_gateways(
    priority_gateway: str, backend: FakeBackend, key: str, rank: int, scope: str
) -> None:
    with sdk_for(priority_gateway, key) as sdk:
        chat(sdk, **OWNED)
    received = backend.received[-1].body
    assert received["priority"] == rank
    assert received["cache_salt"] == expected_salt(scope)
    assert "request_id" not in received
    assert "service_tier" not in received


def test_owned_fields_are_dropped_for_engines_that_do_not_take_them(
    start_gateway: StartGateway, backend: FakeBackend, backend_server: BackendServer
) -> None:
    text = session_policy(backend_server.url, backends={"fake": {"kind": "llamacpp"}})
    with start_gateway(text, health_checks=False) as url, sdk_for(url) as sdk:
        chat(sdk, **OWNED, cache_prompt=True, extra_key="k", rid="r")
    received = backend.received[-1].body
    assert not received.keys() & {*OWNED, "cache_prompt", "extra_key", "rid"}
    assert received["messages"] == MESSAGES


def test_a_stripped_field_is_gone_from_the_forwarded_bytes_when_nothing_else_changed(
    start_gateway: StartGateway, backend: FakeBackend, backend_server: BackendServer
) -> None:
    # An openai-kind backend gets no cache salt: without the strip, the client's bytes go as sent.
    text = session_policy(backend_server.url, backends={"fake": {"kind": "openai"}})
    raw = b'{"model":"test/chat","messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"request_id":"x"}'
    headers = {"authorization": f"Bearer {KEY_ACME}", "content-type": "application/json"}
    with start_gateway(text, health_checks=False) as url:
        assert httpx.post(f"{url}/v1/chat/completions", content=raw, headers=headers).status_code == 200
    # ... and the output bound in the one field an OpenAI chat endpoint reads (gateway/request/output_length.py).
    assert backend.received[-1].body == {"model": CHAT_MODEL, "messages": MESSAGES, "max_completion_tokens": 4}


# --- the policy's extension ------------------------------------------------------------------


def test_a_policy_may_allow_more_fields(
    start_gateway: StartGateway, backend: FakeBackend, backend_server: BackendServer
) -> None:
    text = session_policy(backend_server.url, limits={"extra_body_fields": ["documents", "mm_processor_kwargs"]})
    with start_gateway(text, health_checks=False) as url, sdk_for(url) as sdk:
        chat(sdk, documents=[{"title": "t", "text": "x"}], mm_processor_kwargs={"max_pixels": 1024})
        with pytest.raises(openai.BadRequestError):
            chat(sdk, logits_processors=["x"])  # still refused: not listed
    received = backend.received[-1].body
    assert received["documents"] == [{"title": "t", "text": "x"}]
    assert received["mm_processor_kwargs"] == {"max_pixels": 1024}


@pytest.mark.parametrize(
    "field", ["priority", "cache_salt", "kv_transfer_params", "chat_template", "vllm_xargs", "cache_prompt"]
)
def test_a_policy_can_never_allow_a_field_the_gateway_owns(backend_server: BackendServer, field: str) -> None:
    text = session_policy(backend_server.url, limits={"extra_body_fields": [field]})
    with pytest.raises(PolicyError) as refused:
        parse_policy(text, "policy.yaml")
    assert "extra_body_fields" in str(refused.value)
    assert f"'{field}' is set by the gateway" in str(refused.value)
