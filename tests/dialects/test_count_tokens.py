"""``POST /v1/messages/count_tokens`` end to end: Anthropic's official SDK, the gateway, a simulated engine.

``client.messages.count_tokens(...)`` is passed through to the engine's own endpoint (vLLM's, as
the simulator serves it) whatever cache scopes reach it: counting caches nothing, so no salt is
needed. Its count is what a Messages request of the same conversation reports as
``input_tokens``, and a model none of whose backends counts answers 404 ``api_not_served``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from gateway.dialects.count_tokens import COUNT_TOKENS
from gateway.dialects.messages import MESSAGES
from loadtests.sim import build_engine_app
from tests.conftest import StartGateway
from tests.dialects.test_messages import WEATHER_TOOL, PathRecorder, sdk
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, backend, build_policy, model, tenant
from tests.servers import metric, serve_in_thread

MODEL = "llama"
"""On the simulated engine (kind ``sim``): Messages and its token counting are served."""
OPENAI = "openai-only"
"""On the same engine declared as kind ``openai``: no backend of the model counts tokens."""
SYSTEM = "You are a concise weather assistant."
CONVERSATION: list[Any] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21C."}]},
]


@pytest.fixture
def engine() -> Iterator[tuple[str, PathRecorder]]:
    recorder = PathRecorder(build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=3))
    with serve_in_thread(recorder) as url:
        yield url, recorder


def policy(url: str, *, scopes: int) -> str:
    """The engine as ``sim`` for ``MODEL`` and as ``openai`` for ``OPENAI``, reached by tenants of
    ``scopes`` cache scopes (1: acme alone; 2: acme and globex), no retries."""
    tenants = [tenant("acme", KEY_ACME)]
    if scopes == 2:
        tenants.append(tenant("globex", KEY_GLOBEX))
    return build_policy(
        version="count-tokens-1",
        models=[
            model(name, upstream_name="served", max_prompt_tokens=4096, max_output_tokens=64)
            for name in (MODEL, OPENAI)
        ],
        backends=[backend("engine", url, [MODEL], kind="sim"), backend("openai", url, [OPENAI], kind="openai")],
        tenants=tenants,
        retry={"max_retries": 0},
    )


@pytest.mark.parametrize(
    ("scopes", "message_path"), [(1, "/v1/messages"), (2, "/v1/chat/completions")], ids=["one scope", "two scopes"]
)
def test_the_count_is_the_input_tokens_of_a_message_of_the_same_conversation(
    start_gateway: StartGateway, engine: tuple[str, PathRecorder], tmp_path: Path, scopes: int, message_path: str
) -> None:
    url, recorder = engine
    with (
        start_gateway(policy(url, scopes=scopes), health_checks=False, rollout_dir=str(tmp_path)) as gateway,
        sdk(gateway) as client,
    ):
        counted = client.messages.count_tokens(
            model=MODEL,
            system=SYSTEM,
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            messages=CONVERSATION,
        )
        created = client.messages.create(
            model=MODEL,
            max_tokens=3,
            system=SYSTEM,
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            messages=CONVERSATION,
        )
        raw = httpx.post(
            f"{gateway}/v1/messages/count_tokens",
            headers={"x-api-key": KEY_ACME},
            json={"model": MODEL, "messages": CONVERSATION[:1]},
        )
        counts = metric(gateway, "gateway_requests_total", model=MODEL, api="count_tokens", status="200")
        input_tokens = metric(gateway, "gateway_tokens_total", model=MODEL, api="count_tokens", direction="input")
        output_tokens = metric(gateway, "gateway_tokens_total", model=MODEL, api="count_tokens", direction="output")
    assert counted.input_tokens > 0
    assert counted.input_tokens == created.usage.input_tokens
    # passed through even where two cache scopes reach the engine (a Messages request is translated there)
    assert recorder.paths == ["/v1/messages/count_tokens", message_path, "/v1/messages/count_tokens"]
    assert raw.status_code == 200
    small = raw.json()["input_tokens"]
    assert raw.json() == {"input_tokens": small, "context_management": {"original_input_tokens": small}}
    assert 0 < small < counted.input_tokens
    assert counts == 2
    assert input_tokens == counted.input_tokens + small  # the engine's count is the usage recorded
    assert output_tokens == 0


def test_errors_reach_the_sdk_in_anthropic_s_shape(
    start_gateway: StartGateway, engine: tuple[str, PathRecorder], tmp_path: Path
) -> None:
    url, recorder = engine
    ask: list[Any] = [{"role": "user", "content": "Hi"}]
    with (
        start_gateway(policy(url, scopes=1), health_checks=False, rollout_dir=str(tmp_path)) as gateway,
        sdk(gateway, "sk-nobody") as stranger,
        sdk(gateway) as client,
    ):
        with pytest.raises(anthropic.AuthenticationError) as bad_key:
            stranger.messages.count_tokens(model=MODEL, messages=ask)
        with pytest.raises(anthropic.NotFoundError) as not_served:
            client.messages.count_tokens(model=OPENAI, messages=ask)

        def post(body: dict[str, Any]) -> httpx.Response:
            return httpx.post(f"{gateway}/v1/messages/count_tokens", headers={"x-api-key": KEY_ACME}, json=body)

        bounded = post({"model": MODEL, "max_tokens": 8, "messages": ask})
        streamed = post({"model": MODEL, "stream": True, "messages": ask})
        no_messages = post({"model": MODEL})
        wrong_method = httpx.get(f"{gateway}/v1/messages/count_tokens", headers={"x-api-key": KEY_ACME})
        refused = metric(gateway, "gateway_requests_total", api="count_tokens", status="404")
    assert bad_key.value.status_code == 401
    assert bad_key.value.body["type"] == "error"  # type: ignore[index]
    assert bad_key.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert not_served.value.status_code == 404
    assert not_served.value.body["type"] == "error"  # type: ignore[index]
    assert not_served.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert not_served.value.body["error"]["code"] == "api_not_served"  # type: ignore[index]
    for answer, code, param in (
        (bounded, "unsupported_field", "max_tokens"),  # nothing is generated: no bound to give
        (streamed, "invalid_field", "stream"),
        (no_messages, "invalid_field", "messages"),
    ):
        assert answer.status_code == 400
        error = orjson.loads(answer.content)
        assert error["type"] == "error"
        assert (error["error"]["type"], error["error"]["code"], error["error"]["param"]) == (
            "invalid_request_error",
            code,
            param,
        )
    assert wrong_method.status_code == 405
    assert orjson.loads(wrong_method.content)["type"] == "error"
    assert refused == 1
    assert recorder.paths == []  # none of them reached the engine


def test_a_counted_conversation_renders_apart_from_the_same_message() -> None:
    body: dict[str, Any] = {"model": MODEL, "system": SYSTEM, "tools": [WEATHER_TOOL], "messages": CONVERSATION}
    message = MESSAGES.render({**body, "max_tokens": 8})
    counted = COUNT_TOKENS.render(body)
    assert isinstance(message, str)
    assert isinstance(counted, str)
    assert message in counted  # equal count requests meet on one backend
    assert not counted.startswith(message[:1])  # but no prefix key in common with the inference prompt
