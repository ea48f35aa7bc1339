"""The engine over HTTP: vLLM's response shapes, prefix metrics, aborts, errors, profiles."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import openai
import orjson
import pytest

from loadtests.sim.server import EngineApp
from loadtests.sim.tokenizer import count_tokens, render_chat
from tests.servers import metric, wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SIM = "sim-model"
Engine = Callable[..., AbstractContextManager[tuple[str, EngineApp]]]


def sse_events(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", url + path, json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [orjson.loads(d) for d in data[:-1]]


def chat(content: str, model: str = MODEL, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def test_chat_stream_with_usage_has_vllm_chunk_sequence(sim_engine: Engine) -> None:
    with sim_engine("llama-3.1-8b-h100", time_scale=0.1) as (url, _):
        body = chat("Tell me a story.", max_tokens=4, stream=True, stream_options={"include_usage": True})
        events = sse_events(url, "/v1/chat/completions", body)
    role, *content, last, usage = events
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert len(content) == 3
    assert all(c["usage"] is None and c["choices"][0]["finish_reason"] is None for c in content)
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in content)
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"] is None
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 4
    assert "prompt_tokens_details" not in usage["usage"]  # vLLM: nothing reused, the key left out (exclude_none)
    assert len({e["id"] for e in events}) == 1


def test_stream_without_include_usage_has_no_usage_field(sim_engine: Engine) -> None:
    with sim_engine("llama-3.1-8b-h100", time_scale=0.1) as (url, _):
        events = sse_events(url, "/v1/chat/completions", chat("Hi.", max_tokens=2, stream=True))
    assert all("usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_completion_stream_chunks_are_text_completion_objects(sim_engine: Engine) -> None:
    with sim_engine("llama-3.1-8b-h100", time_scale=0.1) as (url, _):
        body = {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = sse_events(url, "/v1/completions", body)
    assert [e["object"] for e in events] == ["text_completion"] * 4
    assert [bool(e["choices"]) for e in events] == [True, True, True, False]
    assert events[2]["choices"][0]["finish_reason"] == "length"
    assert events[3]["usage"]["prompt_tokens"] == 4


def test_openai_sdk_gets_exactly_max_completion_tokens(sim_engine: Engine) -> None:
    with sim_engine("llama-3.1-8b-h100", time_scale=0.1) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count."}], max_completion_tokens=7
        )
        streamed = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count."}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(streamed)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 7
    assert reply.choices[0].finish_reason == "length"
    assert len((reply.choices[0].message.content or "").split()) == 7
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16  # same prompt as before


def test_continue_final_message_puts_the_partial_answer_in_the_prompt(sim_engine: Engine) -> None:
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there, my friend"}]
    with sim_engine("llama-3.1-8b-h100", time_scale=0.1) as (url, _):
        ok = httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": messages,
                "max_tokens": 2,
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
        )
        fresh = httpx.post(
            url + "/v1/chat/completions", json={"model": MODEL, "messages": messages[:1], "max_tokens": 2}
        )
        bad = httpx.post(
            url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "continue_final_message": True}
        )
    assert ok.status_code == 200
    # "Hi there, my friend" adds 5 tokens plus the role marker, and drops the generation prompt
    assert ok.json()["usage"]["prompt_tokens"] > fresh.json()["usage"]["prompt_tokens"] + 4
    assert bad.status_code == 400


@pytest.mark.parametrize("profile", ["llama-3.1-8b-h100", "instant"], ids=["on an engine", "on the instant profile"])
def test_continue_final_message_streams_with_usage_counting_the_continued_prompt(
    sim_engine: Engine, profile: str
) -> None:
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there, my friend"}]
    continued = render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 3,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with sim_engine(profile, time_scale=0.1, model=MODEL) as (url, _):
        events = sse_events(url, "/v1/chat/completions", body)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"continue_final_message": True, "add_generation_prompt": False},
            )
        )
    role, *content, usage = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == " the engine answers"
    assert usage["usage"]["prompt_tokens"] == count_tokens(continued) == 23
    assert usage["usage"]["completion_tokens"] == 3
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == 23


def test_prefix_hits_are_counted_in_tokens_and_isolated_by_cache_salt(sim_engine: Engine) -> None:
    prompt = "word " * 64
    with sim_engine("llama-3.1-8b-h100", time_scale=0.05) as (url, _):
        for salt in (None, None, "tenant-b"):
            body = chat(prompt, max_tokens=1, **({"cache_salt": salt} if salt else {}))
            assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 200
            if salt is None:
                hits_after_unsalted = metric(url, "vllm:prefix_cache_hits_total")
        queries = metric(url, "vllm:prefix_cache_queries_total")
        hits = metric(url, "vllm:prefix_cache_hits_total")
    prompt_tokens = 79  # 64 words + 15 tokens of chat template
    assert queries == 3 * prompt_tokens
    assert hits == hits_after_unsalted == 64  # only the unsalted repeat hit: 4 full blocks


def test_disconnect_aborts_a_stream_and_frees_its_kv_blocks(sim_engine: Engine) -> None:
    with sim_engine("llama-3.1-8b-h100") as (url, app):
        body = chat("A long answer please.", max_tokens=5000, stream=True)
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert metric(url, "vllm:kv_cache_usage_perc") > 0
        wait_until(lambda: metric(url, "sim:requests_aborted_total") == 1, what="the abort to be counted")
        assert metric(url, "vllm:kv_cache_usage_perc") == 0
        assert metric(url, "vllm:num_requests_running") == 0
        assert metric(url, "vllm:request_success_total", finished_reason="abort") == 1
        assert app.engine is not None


def test_disconnect_aborts_a_non_streaming_request(sim_engine: Engine) -> None:
    with sim_engine("llama-3.1-8b-h100") as (url, _):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=chat("Slow.", max_tokens=5000), timeout=0.3)
        wait_until(lambda: metric(url, "sim:requests_aborted_total") == 1, what="the abort to be counted")
        assert metric(url, "vllm:num_requests_running") == 0


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (orjson.dumps(chat("x", "other")), 404),
        (orjson.dumps(chat("x", SIM, n=2)), 400),
        (orjson.dumps(chat("x", SIM, max_tokens="ten")), 400),
        (orjson.dumps({"model": SIM, "messages": []}), 400),
    ],
    ids=[
        "malformed JSON is a 400",
        "an unknown model is a 404",
        "n other than 1 is a 400",
        "a non-integer max_tokens is a 400",
        "empty messages are a 400",
    ],
)
def test_bad_requests_get_vllm_error_shape(sim_engine: Engine, body: bytes, status: int) -> None:
    with sim_engine("instant") as (url, _):
        response = httpx.post(url + "/v1/chat/completions", content=body)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["code"] == status


def test_health_models_and_embeddings(sim_engine: Engine) -> None:
    with sim_engine("llama-3.1-8b-h100", time_scale=0.05) as (url, _):
        health = httpx.get(url + "/health")
        models = httpx.get(url + "/v1/models").json()
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        one = client.embeddings.create(model=MODEL, input="the same text")
        two = client.embeddings.create(model=MODEL, input="the same text")
    assert (health.status_code, health.content) == (200, b"")
    assert models["data"][0]["id"] == MODEL
    assert models["data"][0]["object"] == "model"
    assert one.data[0].embedding == two.data[0].embedding
    assert len(one.data[0].embedding) == 256
    assert one.usage.prompt_tokens == 3


def test_fixed_profile_honours_ttft_and_itl_options(sim_engine: Engine) -> None:
    with sim_engine("fixed", ttft_ms=150, itl_ms=30) as (url, _):
        start = time.monotonic()
        stamps = []
        body = chat("hi", SIM, max_tokens=4, stream=True)
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.monotonic() - start)
    assert 0.14 < stamps[0] < 0.4  # role and first token arrive together after the TTFT
    gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]
    assert all(0.02 < g < 0.1 for g in gaps)


def test_fixed_profile_reports_as_cached_only_the_blocks_it_found(sim_engine: Engine) -> None:
    """The first prompt is computed, not cached; its repeat hits every full block but the last
    token's (what vLLM reports), and the usage agrees with the engine's own hit counter."""
    prompt = "word " * 64
    with sim_engine("fixed", ttft_ms=1, itl_ms=1) as (url, _):
        cached = []
        for _ in range(2):
            answer = httpx.post(url + "/v1/chat/completions", json=chat(prompt, SIM, max_tokens=1)).json()
            cached.append((answer["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0))
        hits = metric(url, "vllm:prefix_cache_hits_total")
    assert cached == [0, 64]
    assert hits == 64


def test_instant_profile_answers_without_delay_and_streams(sim_engine: Engine) -> None:
    with sim_engine("instant") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        reply = client.chat.completions.create(model=SIM, messages=[{"role": "user", "content": "x"}], max_tokens=16)
        events = sse_events(url, "/v1/chat/completions", chat("x", SIM, max_tokens=3, stream=True))
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 16
    assert len(events) == 4
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_time_scale_stretches_simulated_durations(sim_engine: Engine) -> None:
    with sim_engine("llama-3.2-1b-l4", time_scale=4.0) as (url, app):
        start = time.monotonic()
        httpx.post(
            url + "/v1/chat/completions", json=chat("hi", "meta-llama/Llama-3.2-1B-Instruct", max_tokens=20), timeout=10
        )
        elapsed = time.monotonic() - start
    assert app.engine is not None
    # 20 decode steps of ~11.3 ms each (1B weights at 240 GB/s + 1 ms overhead), times 4
    assert 20 * 0.0113 * 4 * 0.9 < elapsed < 20 * 0.0113 * 4 * 1.5
