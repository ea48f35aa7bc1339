"""The simulator reports the prompt tokens it reused exactly as vLLM and llama.cpp do
(``loadtests/sim/usage_report.py``): a simulated engine on a loopback port, raw HTTP, and the
exact JSON of whole answers and of every stream chunk.

A prefix hit is made by sending the same prompt twice: the second finds the first's blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from loadtests.sim import SIM_MODEL_NAME, build_engine_app
from tests.servers import serve_in_thread

BLOCK = 16
PROMPT_IDS = list(range(1000, 1100))  # 100 prompt tokens: 6 whole blocks before the last token
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
VLLM_USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"]
LLAMACPP_USAGE_KEYS = ["completion_tokens", "prompt_tokens", "total_tokens", "prompt_tokens_details"]
TIMINGS_KEYS = [
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
]


def _body(path: str, **extra: Any) -> dict[str, Any]:
    if path == CHAT:
        words = " ".join(f"w{i}" for i in range(120))
        return {"model": SIM_MODEL_NAME, "messages": [{"role": "user", "content": words}], "max_tokens": 3, **extra}
    return {"model": SIM_MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 3, **extra}


def _whole_hit(prompt: int) -> int:
    """What vLLM finds cached of a prompt seen before: its whole blocks, the last token left out."""
    return (prompt - 1) // BLOCK * BLOCK


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> Iterator[str]:
    """A simulated engine (fixed profile, 1 ms delays) built with ``request.param``'s options."""
    options: dict[str, Any] = getattr(request, "param", {})
    profile = options.pop("profile", "fixed")
    timing: dict[str, Any] = {"ttft_ms": 1.0, "itl_ms": 1.0} if profile == "fixed" else {}
    with serve_in_thread(build_engine_app(profile, **timing, **options)) as url:
        yield url


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    response = httpx.post(url + path, json=body, timeout=10)
    assert response.status_code == 200, response.text
    return response


def _stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's data chunks, in order, checked to end with ``data: [DONE]``."""
    events = _post(url, path, {**body, "stream": True}).text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-2])
    return [orjson.loads(e[len("data: ") :]) for e in events[:-2]]


def _finish_index(chunks: list[dict[str, Any]]) -> int:
    (index,) = [i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0].get("finish_reason")]
    return index


# --- vLLM, started with --enable-prompt-tokens-details (the default) ------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_vllm_whole_answer_has_null_details_without_a_hit_and_the_whole_blocks_with_one(
    engine: str, path: str
) -> None:
    first = _post(engine, path, _body(path))
    assert b'"prompt_tokens_details":null' in first.content
    use = first.json()["usage"]
    prompt = use["prompt_tokens"]
    assert prompt >= 100
    assert list(use) == VLLM_USAGE_KEYS
    assert use == {
        "prompt_tokens": prompt,
        "total_tokens": prompt + 3,
        "completion_tokens": 3,
        "prompt_tokens_details": None,
    }
    second = _post(engine, path, _body(path)).json()["usage"]
    assert list(second) == VLLM_USAGE_KEYS
    assert second["prompt_tokens_details"] == {"cached_tokens": _whole_hit(prompt)}
    assert second["prompt_tokens_details"]["cached_tokens"] > 0
    assert "timings" not in first.json()


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_vllm_stream_has_the_details_only_on_its_final_usage_chunk_and_only_after_a_hit(
    engine: str, path: str
) -> None:
    body = _body(path, stream_options={"include_usage": True})
    first = _stream(engine, path, body)
    assert first[-1]["choices"] == []
    assert list(first[-1]["usage"]) == VLLM_USAGE_KEYS[:3], "exclude_none: absent, not null"
    assert all(c["usage"] is None for c in first[:-1]), "vLLM's null usage on every other chunk"
    prompt = first[-1]["usage"]["prompt_tokens"]
    second = _stream(engine, path, body)
    assert list(second[-1]["usage"]) == VLLM_USAGE_KEYS
    assert second[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": _whole_hit(prompt)}
    assert all(c["usage"] is None for c in second[:-1])
    assert not any("timings" in c for c in first + second)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_vllm_s_per_chunk_usage_never_has_the_details(engine: str, path: str) -> None:
    body = _body(path, stream_options={"include_usage": True, "continuous_usage_stats": True})
    _post(engine, path, _body(path))  # the prefix is cached from now on
    chunks = _stream(engine, path, body)
    *per_chunk, final = chunks
    assert per_chunk
    for chunk in per_chunk:
        assert list(chunk["usage"]) == VLLM_USAGE_KEYS[:3]
    assert final["choices"] == []
    assert final["usage"]["prompt_tokens_details"] == {"cached_tokens": _whole_hit(final["usage"]["prompt_tokens"])}


@pytest.mark.parametrize("engine", [{"prompt_tokens_details": False}], indirect=True)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_vllm_without_the_flag_never_reports_the_hit(engine: str, path: str) -> None:
    _post(engine, path, _body(path))
    whole = _post(engine, path, _body(path))
    assert whole.json()["usage"]["prompt_tokens_details"] is None
    chunks = _stream(engine, path, _body(path, stream_options={"include_usage": True}))
    assert list(chunks[-1]["usage"]) == VLLM_USAGE_KEYS[:3]


@pytest.mark.parametrize("engine", [{"prompt_tokens_details": False}], indirect=True)
def test_the_responses_api_reports_the_hit_whatever_the_flag(engine: str) -> None:
    """vLLM's Responses path fills ``input_tokens_details.cached_tokens`` unconditionally (0 included)."""
    body = {"model": SIM_MODEL_NAME, "input": " ".join(f"w{i}" for i in range(120)), "max_output_tokens": 3}
    first = _post(engine, "/v1/responses", body).json()["usage"]
    assert first["input_tokens_details"]["cached_tokens"] == 0
    second = _post(engine, "/v1/responses", body).json()["usage"]
    assert second["input_tokens_details"]["cached_tokens"] == _whole_hit(second["input_tokens"]) > 0


@pytest.mark.parametrize("engine", [{"profile": "instant"}], indirect=True)
def test_the_instant_profile_answers_in_vllm_s_shape_too(engine: str) -> None:
    whole = _post(engine, COMPLETIONS, _body(COMPLETIONS)).json()
    assert whole["usage"]["prompt_tokens_details"] is None
    chunks = _stream(engine, CHAT, _body(CHAT, stream_options={"include_usage": True}))
    assert list(chunks[-1]["usage"]) == VLLM_USAGE_KEYS[:3]


# --- llama.cpp ------------------------------------------------------------------------------


def _check_timings(timings: dict[str, Any], *, prompt: int, cached: int, predicted: int) -> None:
    assert list(timings) == TIMINGS_KEYS
    assert (timings["cache_n"], timings["prompt_n"], timings["predicted_n"]) == (cached, prompt - cached, predicted)
    assert timings["prompt_ms"] > 0, "the fixed profile's TTFT"
    assert timings["prompt_per_token_ms"] == pytest.approx(timings["prompt_ms"] / timings["prompt_n"])
    assert timings["prompt_per_second"] == pytest.approx(1e3 * timings["prompt_n"] / timings["prompt_ms"])


@pytest.mark.parametrize("engine", [{"answer_format": "llamacpp"}], indirect=True)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_llamacpp_always_reports_the_cached_tokens_and_its_timings_last(engine: str, path: str) -> None:
    first = _post(engine, path, _body(path)).json()
    prompt = first["usage"]["prompt_tokens"]
    assert list(first["usage"]) == LLAMACPP_USAGE_KEYS
    assert first["usage"] == {
        "completion_tokens": 3,
        "prompt_tokens": prompt,
        "total_tokens": prompt + 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert list(first)[-1] == "timings"
    _check_timings(first["timings"], prompt=prompt, cached=0, predicted=3)
    second = _post(engine, path, _body(path)).json()
    cached = _whole_hit(prompt)
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    _check_timings(second["timings"], prompt=prompt, cached=cached, predicted=3)


@pytest.mark.parametrize("engine", [{"answer_format": "llamacpp"}], indirect=True)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_llamacpp_stream_puts_the_timings_on_its_usage_chunk(engine: str, path: str) -> None:
    _post(engine, path, _body(path))
    body = _body(path, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = _stream(engine, path, body)
    *others, last = chunks
    assert last["choices"] == []
    prompt = last["usage"]["prompt_tokens"]
    assert list(last["usage"]) == LLAMACPP_USAGE_KEYS
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": _whole_hit(prompt)}
    assert list(last)[-1] == "timings"
    _check_timings(last["timings"], prompt=prompt, cached=_whole_hit(prompt), predicted=3)
    for chunk in others:  # no vLLM null usage, no per-chunk usage (llama.cpp knows neither), no timings
        assert "usage" not in chunk, chunk
        assert "timings" not in chunk, chunk


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "engine", [{"answer_format": "llamacpp"}, {"answer_format": "llamacpp", "profile": "instant"}], indirect=True
)
@pytest.mark.parametrize("tools", [{}, {"tools": [TOOL], "tool_choice": "required"}], ids=["text", "tool_call"])
def test_without_a_usage_chunk_llamacpp_puts_the_timings_on_the_finish_reason_chunk(
    engine: str, tools: dict[str, Any]
) -> None:
    chunks = _stream(engine, CHAT, _body(CHAT, **tools))
    finish = _finish_index(chunks)
    assert finish == len(chunks) - 1, "no usage chunk after it"
    timings = chunks[finish]["timings"]
    assert list(timings) == TIMINGS_KEYS
    assert (timings["cache_n"], timings["predicted_n"]) == (0, 3)
    assert timings["prompt_n"] > 100
    assert not any("timings" in c or "usage" in c for c in chunks[:finish])


@pytest.mark.parametrize("engine", [{"answer_format": "llamacpp", "profile": "instant"}], indirect=True)
def test_the_instant_profile_s_timings_take_no_time(engine: str) -> None:
    """Nothing is measured without an engine: 0 ms, and llama.cpp's null for a rate over 0 ms."""
    timings = _post(engine, COMPLETIONS, _body(COMPLETIONS)).json()["timings"]
    assert (timings["prompt_ms"], timings["prompt_per_second"], timings["predicted_per_second"]) == (0.0, None, None)
    assert timings["prompt_per_token_ms"] == 0.0


@pytest.mark.parametrize("engine", [{"answer_format": "llamacpp-legacy"}], indirect=True)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_legacy_llamacpp_reports_the_reuse_only_in_its_timings(engine: str, path: str) -> None:
    first = _post(engine, path, _body(path)).json()
    prompt = first["usage"]["prompt_tokens"]
    assert first["usage"] == {"completion_tokens": 3, "prompt_tokens": prompt, "total_tokens": prompt + 3}
    assert first["timings"]["cache_n"] == 0
    second = _post(engine, path, _body(path)).json()
    assert "prompt_tokens_details" not in second["usage"]
    assert second["timings"]["cache_n"] == _whole_hit(prompt)
    chunks = _stream(engine, path, _body(path, stream_options={"include_usage": True}))
    assert list(chunks[-1]["usage"]) == LLAMACPP_USAGE_KEYS[:3]
    assert chunks[-1]["timings"]["cache_n"] == _whole_hit(prompt)
    assert not any("timings" in c for c in chunks[:-1])
