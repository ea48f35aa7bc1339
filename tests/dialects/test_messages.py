"""``POST /v1/messages`` end to end: Anthropic's official SDK, the gateway, simulated engines.

Two ways to answer, one client's view: passed through to the engine's own ``/v1/messages``
where that weakens nothing (one cache scope reaches the engine), translated to chat completions
where the engine's Messages endpoint would drop the tenant's ``cache_salt`` (two scopes reach
it). The engines record which path each request came in on, so each test knows which way it went.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from starlette.types import Receive, Scope, Send

from gateway.service import load_policy
from gateway.settings import Settings
from loadtests.sim import build_engine_app
from tests.conftest import StartGateway
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, admin_keys, backend, build_policy, model, tenant
from tests.servers import admin_url, metric, samples, serve_gateway_in_thread, serve_in_thread, wait_until

MODEL = "llama"
ADMIN_KEY = "admin-key-for-messages-tests"
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


class PathRecorder:
    """An engine app that notes the path of every POST it serves (which API the gateway called)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.paths: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope["path"].startswith("/admin"):
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


@pytest.fixture
def engine() -> Iterator[tuple[str, PathRecorder]]:
    recorder = PathRecorder(build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=3))
    with serve_in_thread(recorder) as url:
        yield url, recorder


def policy(url: str, *, scopes: int, **sections: Any) -> str:
    """One engine, reached by tenants of ``scopes`` cache scopes (1: acme alone; 2: acme and globex)."""
    tenants = [tenant("acme", KEY_ACME)]
    if scopes == 2:
        tenants.append(tenant("globex", KEY_GLOBEX))
    return build_policy(
        version="messages-1",
        models=[model(MODEL, upstream_name="served", max_prompt_tokens=4096, max_output_tokens=64)],
        backends=[backend("engine", url, [MODEL], kind="sim")],
        tenants=tenants,
        **sections,
    )


OPEN_CLIENTS: list[anthropic.Anthropic] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Close every SDK client a test made (their pooled connections would outlive it)."""
    yield
    while OPEN_CLIENTS:
        OPEN_CLIENTS.pop().close()


def sdk(url: str, key: str = KEY_ACME, **options: Any) -> anthropic.Anthropic:
    credentials = options or {"api_key": key}
    client = anthropic.Anthropic(base_url=url, max_retries=0, timeout=20, **credentials)
    OPEN_CLIENTS.append(client)
    return client


def shape(events: list[Any]) -> list[tuple[str, ...]]:
    """A Messages stream as its event types, with each block's and delta's type."""
    out = []
    for event in events:
        if event.type == "content_block_start":
            out.append((event.type, event.content_block.type))
        elif event.type == "content_block_delta":
            out.append((event.type, event.delta.type))
        else:
            out.append((event.type,))
    return out


RAW_EVENTS = {
    "message_start", "content_block_start", "content_block_delta", "content_block_stop",
    "message_delta", "message_stop",
}  # fmt: skip
"""The events on the wire (the SDK's stream helper adds its own, ``text``, ``input_json``, ...)."""


def streamed(client: anthropic.Anthropic, **request: Any) -> tuple[list[Any], Any]:
    with client.messages.stream(**request) as stream:
        events = [event for event in stream if event.type in RAW_EVENTS]
        return events, stream.get_final_message()


@pytest.mark.parametrize(("scopes", "upstream"), [(1, "/v1/messages"), (2, "/v1/chat/completions")])
def test_a_message_whole_streamed_and_with_a_tool(
    start_gateway: StartGateway, engine: tuple[str, PathRecorder], tmp_path: Path, scopes: int, upstream: str
) -> None:
    url, recorder = engine
    with start_gateway(policy(url, scopes=scopes), health_checks=False, rollout_dir=str(tmp_path)) as gateway:
        client = sdk(gateway)
        whole = client.messages.create(
            model=MODEL, max_tokens=5, system="Be brief.", messages=[{"role": "user", "content": "Hello there"}]
        )
        events, final = streamed(
            client, model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
        )
        tool = client.messages.create(
            model=MODEL,
            max_tokens=12,
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            tool_choice={"type": "tool", "name": "get_weather"},
            messages=[{"role": "user", "content": "Weather in Paris?"}],
        )
        call = next(block for block in tool.content if block.type == "tool_use")
        answered = client.messages.create(
            model=MODEL,
            max_tokens=5,
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [block.model_dump() for block in tool.content]},  # type: ignore[misc]
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C"}]},
            ],
        )
        requests = metric(gateway, "gateway_requests_total", model=MODEL, api="messages", status="200")
        output_tokens = metric(gateway, "gateway_tokens_total", model=MODEL, direction="output")
        wait_until(lambda: metric(gateway, "gateway_backend_in_flight_requests") == 0, what="every slot back")
    assert recorder.paths == [upstream] * 4
    assert whole.model == MODEL  # the engine said "served"
    assert whole.type == "message"
    assert whole.role == "assistant"
    assert [b.type for b in whole.content] == ["text"]
    assert whole.content[0].text
    assert whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 5
    assert whole.usage.input_tokens > 0
    assert shape(events) == [
        ("message_start",),
        ("content_block_start", "text"),
        *[("content_block_delta", "text_delta")] * 4,
        ("content_block_stop",),
        ("message_delta",),
        ("message_stop",),
    ]
    assert final.model == MODEL
    assert final.usage.output_tokens == 4
    assert final.usage.input_tokens > 0
    assert final.stop_reason == "max_tokens"
    # vLLM finishes a named tool choice with "stop", which its Messages endpoint passes on as
    # end_turn; translated, the gateway says tool_use, as Anthropic's API does for a tool call
    assert tool.stop_reason == ("end_turn" if upstream == "/v1/messages" else "tool_use")
    assert call.name == "get_weather"
    assert isinstance(call.input, dict)
    assert "city" in call.input
    assert answered.usage.input_tokens > tool.usage.input_tokens  # the tool result reached the engine
    assert requests == 4
    assert output_tokens == 5 + 4 + tool.usage.output_tokens + 5


def test_a_translated_stream_and_a_passthrough_one_give_the_client_the_same_events(
    start_gateway: StartGateway, engine: tuple[str, PathRecorder], tmp_path: Path
) -> None:
    url, recorder = engine
    shapes, finals = [], []
    for scopes in (1, 2):
        with start_gateway(policy(url, scopes=scopes), health_checks=False, rollout_dir=str(tmp_path)) as gateway:
            client = sdk(gateway)
            for request in (
                {"max_tokens": 6, "messages": [{"role": "user", "content": "Tell me a story."}]},
                {
                    "max_tokens": 10,
                    "tools": [WEATHER_TOOL],
                    "tool_choice": {"type": "tool", "name": "get_weather"},
                    "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                },
            ):
                events, final = streamed(client, model=MODEL, **request)
                shapes.append(shape(events))
                finals.append((final.stop_reason, final.usage.output_tokens, [b.type for b in final.content]))
    assert recorder.paths == ["/v1/messages"] * 2 + ["/v1/chat/completions"] * 2
    passthrough, translated = shapes[:2], shapes[2:]
    assert translated == passthrough
    assert finals[2] == finals[0]
    assert finals[3][1:] == finals[1][1:]
    assert (finals[1][0], finals[3][0]) == ("end_turn", "tool_use")  # see test_a_message_whole_streamed_...
    assert ("content_block_start", "tool_use") in passthrough[1]
    assert ("content_block_delta", "input_json_delta") in passthrough[1]


@pytest.mark.parametrize("scopes", [1, 2])
def test_errors_reach_the_sdk_in_anthropic_s_shape(
    start_gateway: StartGateway, engine: tuple[str, PathRecorder], tmp_path: Path, scopes: int
) -> None:
    url, _ = engine
    with start_gateway(policy(url, scopes=scopes), health_checks=False, rollout_dir=str(tmp_path)) as gateway:
        client = sdk(gateway)
        no_bound = httpx.post(  # the SDK checks this one itself: the raw request, as another client sends it
            f"{gateway}/v1/messages",
            headers={"x-api-key": KEY_ACME},
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
        )
        with pytest.raises(anthropic.AuthenticationError) as bad_key:
            sdk(gateway, "sk-nobody").messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
            )
        with pytest.raises(anthropic.NotFoundError) as unknown_model:
            client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        with pytest.raises(anthropic.BadRequestError) as over_cap:
            client.messages.create(model=MODEL, max_tokens=10_000, messages=[{"role": "user", "content": "Hi"}])
        bearer = sdk(gateway, auth_token=KEY_ACME, api_key=None).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
        wrong_method = httpx.get(f"{gateway}/v1/messages", headers={"x-api-key": KEY_ACME})
        two_keys = httpx.post(
            f"{gateway}/v1/messages",
            headers={"x-api-key": KEY_ACME, "authorization": f"Bearer {KEY_GLOBEX}"},
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        )
    assert no_bound.status_code == 400
    assert orjson.loads(no_bound.content) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "'max_tokens' is required.",
            "code": "invalid_field",
            "param": "max_tokens",
        },
    }
    assert bad_key.value.status_code == 401
    assert bad_key.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert unknown_model.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert over_cap.value.body["error"]["code"] == "max_tokens_too_large"  # type: ignore[index]
    assert bearer.usage.output_tokens == 2
    assert wrong_method.status_code == 405
    assert orjson.loads(wrong_method.content)["error"]["type"] == "invalid_request_error"
    assert orjson.loads(wrong_method.content)["type"] == "error"  # Anthropic's shape, before any handler
    assert two_keys.status_code == 400
    assert orjson.loads(two_keys.content)["error"]["code"] == "invalid_header"


@pytest.mark.parametrize("scopes", [1, 2])
def test_a_broken_stream_ends_with_anthropic_s_error_event(
    start_gateway: StartGateway, engine: tuple[str, PathRecorder], tmp_path: Path, scopes: int
) -> None:
    url, _ = engine
    httpx.post(f"{url}/admin/fault", json={"mode": "close_mid_stream", "after_tokens": 2}).raise_for_status()
    seen: list[Any] = []
    with start_gateway(policy(url, scopes=scopes), health_checks=False, rollout_dir=str(tmp_path)) as gateway:
        stream = sdk(gateway).messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
        with pytest.raises(anthropic.APIStatusError) as broken, stream as events:  # noqa: PT012 (the events count)
            for event in events:
                seen.append(event)
        wait_until(lambda: metric(gateway, "gateway_backend_in_flight_requests") == 0, what="every slot back")
        outcomes = {
            labels: value
            for labels, value in samples(gateway, "gateway_requests_total").items()
            if ("api", "messages") in labels and value
        }
    assert [e.type for e in seen if e.type == "content_block_delta"] == ["content_block_delta"] * 2
    assert broken.value.body["type"] == "error"  # type: ignore[index]
    assert broken.value.body["error"]["code"].startswith("upstream_")  # type: ignore[index]
    assert [dict(labels)["outcome"] for labels in outcomes] == [broken.value.body["error"]["code"]]  # type: ignore[index]


class BodyRecorder(PathRecorder):
    """A ``PathRecorder`` that keeps each POST's JSON body too."""

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].startswith("/admin"):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.paths.append(scope["path"])
        self.bodies.append(orjson.loads(b"".join(chunks)))
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def test_a_shadow_copy_of_a_message_is_translated_as_its_primary_and_carries_the_salt(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    recorder = BodyRecorder(build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=3))
    with serve_in_thread(recorder) as url:
        text = build_policy(
            version="messages-shadow",
            models=[
                model("primary", upstream_name="served", max_prompt_tokens=4096, max_output_tokens=64),
                model("shadowed", upstream_name="served", max_prompt_tokens=4096, max_output_tokens=64),
            ],
            backends=[backend("engine", url, ["primary", "shadowed"], kind="sim")],
            model_groups=[
                {"name": MODEL, "targets": [{"model": "primary"}], "shadow": {"model": "shadowed", "percent": 100}}
            ],
            tenants=[tenant("acme", KEY_ACME), tenant("globex", KEY_GLOBEX)],
        )
        with start_gateway(text, health_checks=False, rollout_dir=str(tmp_path)) as gateway:
            answer = sdk(gateway).messages.create(
                model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}]
            )
            wait_until(lambda: len(recorder.paths) == 2, what="the shadow copy to reach the engine")
            wait_until(
                lambda: metric(gateway, "gateway_shadow_requests_total", group=MODEL) == 1, what="the copy to end"
            )
            shadows = metric(gateway, "gateway_shadow_requests_total", group=MODEL, target="shadowed")
    assert answer.model == MODEL
    assert answer.usage.output_tokens == 3
    assert recorder.paths == ["/v1/chat/completions"] * 2  # two cache scopes reach the engine: never unsalted
    assert all(body.get("cache_salt") for body in recorder.bodies)
    assert recorder.bodies[0]["cache_salt"] == recorder.bodies[1]["cache_salt"]  # the tenant's, on both
    assert recorder.bodies[1]["stream"] is True
    assert shadows == 1


def test_a_reload_that_lets_a_second_cache_scope_reach_the_engine_ends_passthrough_at_once(
    engine: tuple[str, PathRecorder], tmp_path: Path
) -> None:
    url, recorder = engine
    path = tmp_path / "policy.yaml"
    admin = {"admin": admin_keys(ADMIN_KEY)}
    path.write_text(policy(url, scopes=1, **admin))
    settings = Settings(policy_path=str(path), health_checks=False, port=0, admin_port=0, rollout_dir=str(tmp_path))
    with serve_gateway_in_thread(settings, load_policy(path)) as built:
        client = sdk(built.api_url)
        ask = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        client.messages.create(**ask)  # type: ignore[arg-type]
        path.write_text(policy(url, scopes=2, **admin).replace("messages-1", "messages-2"))
        reloaded = httpx.post(
            f"{admin_url(built.api_url)}/admin/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"}
        )
        client.messages.create(**ask)  # type: ignore[arg-type]
    assert reloaded.status_code == 200
    assert recorder.paths == ["/v1/messages", "/v1/chat/completions"]  # the salt from the first request on
