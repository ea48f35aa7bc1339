"""Engine features whose cost no token bound limits, end to end: the official SDKs, the gateway and
a simulated engine (issue 27).

The hostile bodies seen from outside (20,000 stop strings, 20,000 banned words, 15,000 logit
biases, 20,000 Messages stop sequences, an ``image_embeds`` part, a Responses ``mcp`` tool aimed at
the metadata service, ``web_search_preview``) are each a 400 naming its field, and none reaches
the engine; the same features within their bounds reach it unchanged; the tensor part and the
built-in tools pass for a tenant whose policy opts in, and an opted-in ``mcp`` tool still cannot
name the metadata service. The engine records every body it is sent, so each test accounts for
every request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send

from loadtests.sim import build_engine_app
from tests.conftest import run_gateway
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, backend, build_policy, model, tenant
from tests.servers import serve_in_thread

MODEL = "llama"
TRUSTED = KEY_GLOBEX
"""The tenant that opts in, where a policy lets one (``trusting_gateway``)."""
ASK: Any = [{"role": "user", "content": "Hello there"}]
EMBEDS = "ZmFrZSB0ZW5zb3I="  # base64 bytes: what a client would send as a serialised tensor
IMAGE_EMBEDS: Any = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "What is this?"}, {"type": "image_embeds", "image_embeds": EMBEDS}],
    }
]
METADATA_MCP: Any = {"type": "mcp", "server_label": "meta", "server_url": "http://169.254.169.254/"}
PUBLIC_MCP: Any = {"type": "mcp", "server_label": "docs", "server_url": "https://mcp.example.com/sse"}
WEB_SEARCH: Any = {"type": "web_search_preview"}


@dataclass
class BodyRecorder:
    """An engine app that keeps the JSON body of every inference request it serves."""

    app: Any
    bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        self.bodies.append((scope["path"], orjson.loads(body) if body else {}))
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


@dataclass
class Gateway:
    url: str
    engine: BodyRecorder


@pytest.fixture(scope="module")
def recorded_engine() -> Iterator[tuple[str, BodyRecorder]]:
    recorder = BodyRecorder(build_engine_app("fixed", model="served", ttft_ms=1, itl_ms=1))
    with serve_in_thread(recorder) as url:
        yield url, recorder


def gateway_policy(engine_url: str, **globex: Any) -> str:
    """acme and globex on one simulated engine; ``globex`` fields: its opt-ins."""
    return build_policy(
        version="engine-features-1",
        models=[model(MODEL, upstream_name="served", max_prompt_tokens=4096, max_output_tokens=64)],
        backends=[backend("engine", engine_url, [MODEL], kind="sim")],
        tenants=[tenant("acme", KEY_ACME), tenant("globex", KEY_GLOBEX, **globex)],
    )


@pytest.fixture(scope="module")
def gateway(recorded_engine: tuple[str, BodyRecorder]) -> Iterator[Gateway]:
    """The default policy: no tenant opted into anything."""
    url, recorder = recorded_engine
    with run_gateway(gateway_policy(url), health_checks=False) as gateway_url:
        yield Gateway(gateway_url, recorder)


@pytest.fixture(scope="module")
def trusting_gateway(recorded_engine: tuple[str, BodyRecorder]) -> Iterator[Gateway]:
    """globex opted into ``image_embeds`` parts and the ``web_search_preview`` and ``mcp`` tools."""
    url, recorder = recorded_engine
    opt_ins = {"allow_content_parts": ["image_embeds"], "allow_builtin_tools": ["web_search_preview", "mcp"]}
    with run_gateway(gateway_policy(url, **opt_ins), health_checks=False) as gateway_url:
        yield Gateway(gateway_url, recorder)


@pytest.fixture
def engine(recorded_engine: tuple[str, BodyRecorder]) -> BodyRecorder:
    recorder = recorded_engine[1]
    recorder.bodies.clear()
    return recorder


def openai_sdk(url: str, key: str = KEY_ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def anthropic_sdk(url: str, key: str = KEY_ACME) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=30)


def strings(n: int) -> list[str]:
    return [f"s{i}" for i in range(n)]


def biases(n: int) -> dict[str, int]:
    return {str(token): -100 for token in range(n)}


Call = Callable[[str], Any]
"""One request through an official SDK to the gateway at the URL, as tenant acme."""


def chat(**fields: Any) -> Call:
    def send(url: str) -> Any:
        with openai_sdk(url) as client:
            return client.chat.completions.create(model=MODEL, max_tokens=4, **{"messages": ASK, **fields})

    return send


def responses(**fields: Any) -> Call:
    def send(url: str) -> Any:
        with openai_sdk(url) as client:
            return client.responses.create(model=MODEL, input="Hello there", max_output_tokens=4, **fields)

    return send


def messages(**fields: Any) -> Call:
    def send(url: str) -> Any:
        with anthropic_sdk(url) as client:
            return client.messages.create(model=MODEL, max_tokens=4, messages=ASK, **fields)

    return send


HOSTILE = [
    pytest.param(chat(stop=strings(20_000)), "too_many_items", "stop", id="chat: stop with 20,000 strings"),
    pytest.param(
        chat(extra_body={"bad_words": strings(20_000)}), "too_many_items", "bad_words", id="chat: 20,000 bad_words"
    ),
    pytest.param(
        chat(logit_bias=biases(15_000)), "too_many_items", "logit_bias", id="chat: logit_bias with 15,000 entries"
    ),
    pytest.param(
        messages(stop_sequences=strings(20_000)),
        "too_many_items",
        "stop_sequences",
        id="messages: stop_sequences with 20,000 strings",
    ),
    pytest.param(
        chat(messages=IMAGE_EMBEDS),
        "content_part_not_allowed",
        "messages[0].content[1].type",
        id="chat: an image_embeds part",
    ),
    pytest.param(
        responses(tools=[METADATA_MCP]),
        "tool_type_not_allowed",
        "tools[0].type",
        id="responses: an mcp tool whose server is the metadata service",
    ),
    pytest.param(
        responses(tools=[WEB_SEARCH]), "tool_type_not_allowed", "tools[0].type", id="responses: web_search_preview"
    ),
    pytest.param(  # two cache scopes reach the engine: this request would be translated to chat
        messages(tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]),
        "tool_type_not_allowed",
        "tools[0].type",
        id="messages: a server tool, refused before its translation to chat",
    ),
]


def refused(call: Call, url: str) -> tuple[int, Any, Any]:
    """Status, code and param of the error ``call`` raises (each SDK's shape)."""
    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as caught:
        call(url)
    error = caught.value
    body = error.body
    assert isinstance(body, dict)
    detail = body["error"] if isinstance(body.get("error"), dict) else body  # Anthropic's shape nests it
    return error.status_code, detail.get("code"), detail.get("param")


@pytest.mark.parametrize(("call", "code", "param"), HOSTILE)
def test_an_engine_feature_beyond_its_bound_is_refused_before_the_engine(
    gateway: Gateway, engine: BodyRecorder, call: Call, code: str, param: str
) -> None:
    assert refused(call, gateway.url) == (400, code, param)
    assert engine.bodies == [], "nothing reached the engine"


WITHIN_BOUNDS = [
    pytest.param(chat(stop=strings(16)), "stop", strings(16), id="chat: 16 stop strings"),
    pytest.param(chat(extra_body={"bad_words": strings(128)}), "bad_words", strings(128), id="chat: 128 bad_words"),
    pytest.param(chat(logit_bias=biases(300)), "logit_bias", biases(300), id="chat: 300 logit biases"),
    pytest.param(  # two cache scopes reach the engine: Messages goes to it translated to chat
        messages(stop_sequences=strings(16)), "stop", strings(16), id="messages: 16 stop sequences"
    ),
]


@pytest.mark.parametrize(("call", "name", "value"), WITHIN_BOUNDS)
def test_the_same_features_within_their_bounds_reach_the_engine_unchanged(
    gateway: Gateway, engine: BodyRecorder, call: Call, name: str, value: Any
) -> None:
    call(gateway.url)
    [(_, body)] = engine.bodies
    assert body[name] == value


def trusted(call: Callable[[openai.OpenAI], Any], url: str) -> Any:
    with openai_sdk(url, TRUSTED) as client:
        return call(client)


def test_a_tenant_that_opted_into_image_embeds_may_send_them(trusting_gateway: Gateway, engine: BodyRecorder) -> None:
    answer = trusted(
        lambda client: client.chat.completions.create(model=MODEL, max_tokens=4, messages=IMAGE_EMBEDS),
        trusting_gateway.url,
    )
    assert answer.choices[0].message.content
    [(path, body)] = engine.bodies
    assert (path, body["messages"]) == ("/v1/chat/completions", IMAGE_EMBEDS)


@pytest.mark.parametrize("tool", [WEB_SEARCH, PUBLIC_MCP], ids=["web_search_preview", "mcp on a public https server"])
def test_a_tenant_that_opted_into_a_built_in_tool_may_declare_it(
    trusting_gateway: Gateway, engine: BodyRecorder, tool: Any
) -> None:
    answer = trusted(
        lambda client: client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, tools=[tool]),
        trusting_gateway.url,
    )
    assert answer.output_text
    [(path, body)] = engine.bodies
    assert (path, body["tools"]) == ("/v1/responses", [tool])


def test_an_opted_in_mcp_tool_still_cannot_name_the_metadata_service(
    trusting_gateway: Gateway, engine: BodyRecorder
) -> None:
    def call(url: str) -> Any:
        return trusted(
            lambda client: client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, tools=[METADATA_MCP]),
            url,
        )

    assert refused(call, trusting_gateway.url) == (400, "server_url_not_allowed", "tools[0].server_url")
    assert engine.bodies == []


def test_an_opt_in_is_the_tenants_own(trusting_gateway: Gateway, engine: BodyRecorder) -> None:
    """acme shares the gateway and the engine with globex, which opted in; acme did not."""
    assert refused(chat(messages=IMAGE_EMBEDS), trusting_gateway.url) == (
        400,
        "content_part_not_allowed",
        "messages[0].content[1].type",
    )
    assert refused(responses(tools=[WEB_SEARCH]), trusting_gateway.url) == (
        400,
        "tool_type_not_allowed",
        "tools[0].type",
    )
    assert engine.bodies == []
