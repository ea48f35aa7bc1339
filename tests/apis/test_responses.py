"""``POST /v1/responses`` end to end: the official ``openai`` SDK, the gateway, a simulated engine.

Everything chat gets: limits, admission, tenant-scoped routing with the cache salt, metrics by
API; the typed events relayed with their names (TTFT from the first output delta, usage from
``response.completed``); ``previous_response_id`` sent to the backend that holds the response,
and only for the tenant that created it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtests.sim import build_engine_app
from tests.conftest import StartGateway
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, backend, build_policy, model, tenant
from tests.servers import metric, serve_in_thread

MODEL = "llama"


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
