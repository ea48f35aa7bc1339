"""``POST /v1/responses`` end to end: the official ``openai`` SDK, the gateway, a simulated engine.

Everything chat gets: limits, admission, tenant-scoped routing with the cache salt, metrics by
API; the typed events relayed with their names (TTFT from the first output delta, usage from
``response.completed``); ``previous_response_id`` sent to the backend that holds the response,
and only for the tenant that created it.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseFunctionToolCall

from loadtests.sim import build_engine_app
from tests.conftest import StartGateway
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, backend, build_policy, model, tenant
from tests.servers import free_port, metric, serve_in_thread, server_in_thread, wait_until

MODEL = "llama"
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
def engines() -> Iterator[tuple[str, str]]:
    with ExitStack() as stack:
        yield tuple(  # type: ignore[misc]
            stack.enter_context(serve_in_thread(build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=5)))
            for _ in range(2)
        )


def policy(urls: tuple[str, str], **sections: Any) -> str:
    return build_policy(
        version="responses-1",
        models=[model(MODEL, upstream_name="served", max_prompt_tokens=4096, max_output_tokens=64)],
        backends=[backend(f"engine-{i}", url, [MODEL], kind="sim") for i, url in enumerate(urls)],
        tenants=[tenant("acme", KEY_ACME), tenant("globex", KEY_GLOBEX)],
        **sections,
    )


def sdk(url: str, key: str = KEY_ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20)


def test_a_response_whole_and_streamed(start_gateway: StartGateway, engines: tuple[str, str], tmp_path: Path) -> None:
    with start_gateway(policy(engines), health_checks=False, rollout_dir=str(tmp_path)) as url:
        client = sdk(url)
        whole = client.responses.create(model=MODEL, instructions="Be brief.", input="Hello there", max_output_tokens=4)
        events = list(
            client.responses.create(
                model=MODEL, input=[{"role": "user", "content": "Hi"}], max_output_tokens=3, stream=True
            )
        )
        ttft = metric(url, "gateway_ttft_seconds_count", model=MODEL, **{"class": "interactive"})
        requests = metric(
            url, "gateway_requests_total", model=MODEL, api="responses", status="200", outcome="completed"
        )
        output_tokens = metric(url, "gateway_tokens_total", model=MODEL, direction="output")
    assert whole.model == MODEL  # the engine said "served"
    assert whole.output_text
    assert whole.usage is not None
    assert whole.usage.output_tokens == 4
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response  # type: ignore[union-attr]
    assert "".join(deltas) == final.output_text
    assert final.model == MODEL
    assert requests == 2
    assert ttft == 1  # the streamed one: timed from its first output delta
    assert output_tokens == 4 + 3


def test_a_follow_up_goes_to_the_backend_that_holds_the_response(
    start_gateway: StartGateway, engines: tuple[str, str], tmp_path: Path
) -> None:
    with start_gateway(policy(engines), health_checks=False, rollout_dir=str(tmp_path)) as url:
        client = sdk(url)
        first = client.responses.create(model=MODEL, input="Remember the number 7.", max_output_tokens=4, store=True)
        holder = [i for i, e in enumerate(engines) if metric(e, "vllm:request_success_total", finished_reason="length")]
        follow_ups = [
            client.responses.create(
                model=MODEL, input="Which number?", previous_response_id=first.id, max_output_tokens=4
            )
            for _ in range(6)
        ]
        counts = [metric(e, "vllm:request_success_total", finished_reason="length") for e in engines]
        with pytest.raises(openai.NotFoundError) as other_tenant:
            sdk(url, KEY_GLOBEX).responses.create(model=MODEL, input="Which?", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError) as unknown:
            client.responses.create(model=MODEL, input="Which?", previous_response_id="resp_nope")
    assert len(holder) == 1
    assert counts[holder[0]] == 7
    assert sum(counts) == 7
    assert all(f.usage is not None and f.usage.input_tokens > first.usage.input_tokens for f in follow_ups)  # type: ignore[union-attr]
    assert other_tenant.value.code == unknown.value.code == "previous_response_not_found"
    # Another tenant's id reads exactly as an unknown one: nothing to probe.
    assert other_tenant.value.message.replace(first.id, "<id>") == unknown.value.message.replace("resp_nope", "<id>")


def test_a_broken_stream_ends_with_the_responses_error_event(
    start_gateway: StartGateway, engines: tuple[str, str], tmp_path: Path
) -> None:
    for engine in engines:
        httpx.post(f"{engine}/admin/fault", json={"mode": "close_mid_stream", "after_tokens": 2}).raise_for_status()
    with start_gateway(policy(engines), health_checks=False, rollout_dir=str(tmp_path)) as url:
        events = list(sdk(url).responses.create(model=MODEL, input="Hi", max_output_tokens=8, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 2
    assert events[-1].type == "error"  # the SDK's ResponseErrorEvent: the API's own shape
    assert events[-1].code.startswith("upstream_")  # type: ignore[union-attr]


def test_a_function_call_whole_and_streamed_then_its_output_is_answered(
    start_gateway: StartGateway, engines: tuple[str, str], tmp_path: Path
) -> None:
    forced: Any = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    with start_gateway(policy(engines), health_checks=False, rollout_dir=str(tmp_path)) as url:
        client = sdk(url)
        whole = client.responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=6, **forced)
        events = list(
            client.responses.create(model=MODEL, input="Weather in Oslo?", max_output_tokens=5, stream=True, **forced)
        )
        ttft = metric(url, "gateway_ttft_seconds_count", model=MODEL, **{"class": "interactive"})
        call = whole.output[0]
        assert isinstance(call, ResponseFunctionToolCall)
        result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "18C"}
        by_id = client.responses.create(model=MODEL, input=[result], previous_response_id=whole.id, max_output_tokens=4)
        streamed_call = events[-1].response.output[0]  # type: ignore[union-attr]
        assert isinstance(streamed_call, ResponseFunctionToolCall)
        resent_items: Any = [
            {"role": "user", "content": "Weather in Oslo?"},
            streamed_call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": streamed_call.call_id, "output": "18C"},
        ]
        resent = client.responses.create(model=MODEL, input=resent_items, tools=[WEATHER], max_output_tokens=4)
        requests = metric(
            url, "gateway_requests_total", model=MODEL, api="responses", status="200", outcome="completed"
        )
    # whole: one function call item, no message
    assert [type(o) for o in whole.output] == [ResponseFunctionToolCall]
    assert call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    assert whole.output_text == ""
    assert whole.model == MODEL
    assert whole.usage is not None
    assert whole.usage.output_tokens == 6
    # streamed: argument deltas, one a token, that make the item's arguments; complete at response.completed
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" not in kinds
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) == 5
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert isinstance(done, ResponseFunctionToolCall)
    assert "".join(deltas) == done.arguments == streamed_call.arguments
    assert set(json.loads(done.arguments)) == {"city"}
    assert ttft == 1  # the stream, timed from its first argument delta
    # the call's output sent back, by previous_response_id or with the items resent: a text answer
    for reply in (by_id, resent):
        assert [o.type for o in reply.output] == ["message"]
        assert reply.output_text
        assert reply.usage is not None
        assert reply.usage.output_tokens == 4
    assert requests == 4


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_a_follow_up_whose_holder_is_down_or_lost_the_response_is_told_so(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    port = free_port()
    app = build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=5)
    with ExitStack() as stack:
        other = stack.enter_context(serve_in_thread(build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=5)))
        holder = stack.enter_context(server_in_thread(app, port))
        urls = (other, holder.url)
        gateway = stack.enter_context(start_gateway(policy(urls), rollout_dir=str(tmp_path)))
        wait_until(lambda: metric(gateway, "gateway_model_healthy_backends", model=MODEL) == 2, what="both healthy")
        client = sdk(gateway)
        first = None
        while first is None:  # until a response lands on the engine that will go down
            made = client.responses.create(model=MODEL, input="Remember 7.", max_output_tokens=2)
            if metric(holder.url, "vllm:request_success_total"):
                first = made
        served_before = metric(other, "vllm:request_success_total")  # the tries that landed there
        holder.stop_listening()
        wait_until(lambda: not listening(port), what="the holder to stop")
        with pytest.raises(openai.APIStatusError) as down:
            client.responses.create(model=MODEL, input="Which?", previous_response_id=first.id, max_output_tokens=2)
        fresh = build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=5)  # the same engine, restarted: empty
        stack.enter_context(serve_in_thread(fresh, port))
        wait_until(lambda: metric(gateway, "gateway_model_healthy_backends", model=MODEL) == 2, what="it to be back")
        with pytest.raises(openai.NotFoundError) as lost:
            client.responses.create(model=MODEL, input="Which?", previous_response_id=first.id, max_output_tokens=2)
        served_elsewhere = metric(other, "vllm:request_success_total") - served_before
    assert down.value.status_code in (502, 503)  # never another engine: it has no such response
    assert lost.value.code == "previous_response_not_found"
    assert "start the conversation again" in lost.value.message
    assert served_elsewhere == 0
