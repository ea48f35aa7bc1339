"""The OpenAI dialects read the prompt tokens an engine reused, in each engine's format
(``gateway/dialects/openai_answers.py``): ``Dialect.read_chunk`` (a stream chunk's usage) and
``Dialect.answer_usage`` (a whole answer's) give ``prompt_tokens_details.cached_tokens``, which
``TokenStats.cached_tokens`` reads, for vLLM's, llama.cpp's and old llama.cpp's answers.

The chunks and bodies are the simulator's own (``loadtests/sim/usage_report.py``, checked against
the engines' wire formats by ``tests/sim/test_usage_formats.py``), plus llama.cpp's shapes as its
source writes them.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from gateway.dialects.base import Dialect
from gateway.dialects.chat import CHAT
from gateway.dialects.completions import COMPLETIONS
from gateway.telemetry.token_stats import TokenStats
from loadtests.sim.protocol import Endpoint, StreamRenderer, full_response
from loadtests.sim.stream import TokenStream
from loadtests.sim.usage_report import AnswerFormat, UsageReport

PROMPT, COMPLETION, CACHED = 100, 3, 96
DIALECTS = [(CHAT, Endpoint.CHAT), (COMPLETIONS, Endpoint.COMPLETION)]
dialects = pytest.mark.parametrize(("dialect", "endpoint"), DIALECTS, ids=["chat", "completions"])
formats = pytest.mark.parametrize("answer_format", list(AnswerFormat), ids=lambda f: f.value)


def _finished(cached: int) -> TokenStream:
    stream = TokenStream(PROMPT)
    stream.num_tokens, stream.cached_tokens = COMPLETION, cached
    stream.arrival, stream.first_at, stream.end_at = 1.0, 1.05, 1.2
    return stream


def _cached(usage: Any) -> int | None:
    return TokenStats(0.0, None, (), usage, ()).cached_tokens


def _whole(report: UsageReport, endpoint: Endpoint, cached: int) -> dict[str, Any]:
    stream = _finished(cached)
    use = report.whole(PROMPT, COMPLETION, cached)
    body = full_response(endpoint, "id-1", "m", 1, "abc", "length", use, timings=report.timings(stream))
    document: dict[str, Any] = orjson.loads(body)
    return document


def _renderer(report: UsageReport, endpoint: Endpoint, include_usage: bool) -> StreamRenderer:
    return StreamRenderer(endpoint, "id-1", "m", 1, include_usage and report.vllm)


def _usage_chunk(report: UsageReport, endpoint: Endpoint, cached: int) -> dict[str, Any]:
    use = report.final(PROMPT, COMPLETION, cached)
    event = _renderer(report, endpoint, True).usage_chunk(use, report.timings(_finished(cached)))
    chunk: dict[str, Any] = orjson.loads(event[len(b"data: ") :])
    return chunk


@formats
@dialects
def test_a_whole_answer_s_usage_has_the_cached_tokens(
    dialect: Dialect, endpoint: Endpoint, answer_format: AnswerFormat
) -> None:
    document = _whole(UsageReport(answer_format), endpoint, CACHED)
    before = copy.deepcopy(document)
    usage = dialect.answer_usage(document)
    assert usage is not None
    assert usage["prompt_tokens_details"] == {"cached_tokens": CACHED}
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (PROMPT, COMPLETION)
    assert _cached(usage) == CACHED
    assert document == before, "the answer is left as it came"


@formats
@dialects
def test_a_stream_s_usage_chunk_has_the_cached_tokens(
    dialect: Dialect, endpoint: Endpoint, answer_format: AnswerFormat
) -> None:
    chunk = _usage_chunk(UsageReport(answer_format), endpoint, CACHED)
    before = copy.deepcopy(chunk)
    output, usage, reasons, usage_only = dialect.read_chunk(chunk)
    assert (output, reasons, usage_only) == (False, (), True)
    assert usage is not None
    assert usage["prompt_tokens_details"] == {"cached_tokens": CACHED}
    assert _cached(usage) == CACHED
    assert chunk == before, "the relay may forward the chunk's bytes as they came"


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        (UsageReport(AnswerFormat.VLLM), None),  # null (whole) or absent (stream): 0, or the flag is off
        (UsageReport(AnswerFormat.VLLM, prompt_tokens_details=False), None),
        (UsageReport(AnswerFormat.LLAMACPP), 0),
        (UsageReport(AnswerFormat.LLAMACPP_LEGACY), 0),  # timings.cache_n: 0
    ],
    ids=["vllm", "vllm-no-flag", "llamacpp", "llamacpp-legacy"],
)
@dialects
def test_nothing_cached_reads_as_each_engine_says_it(
    dialect: Dialect, endpoint: Endpoint, report: UsageReport, expected: int | None
) -> None:
    whole = dialect.answer_usage(_whole(report, endpoint, 0))
    _, streamed, _, _ = dialect.read_chunk(_usage_chunk(report, endpoint, 0))
    assert whole is not None
    assert streamed is not None
    assert (_cached(whole), _cached(streamed)) == (expected, expected)
    assert whole["prompt_tokens"] == streamed["prompt_tokens"] == PROMPT


@formats
@dialects
def test_a_chunk_without_usage_reads_no_usage(
    dialect: Dialect, endpoint: Endpoint, answer_format: AnswerFormat
) -> None:
    """Token chunks (vLLM's carry ``"usage": null``, llama.cpp's no key) and the finish chunk
    without a usage chunk after it, which carries llama.cpp's timings: no usage, so a cached count
    is read only from the usage chunk the gateway always asks for."""
    report = UsageReport(answer_format)
    renderer = _renderer(report, endpoint, True)
    token = orjson.loads(renderer.content(" a")[len(b"data: ") :])
    finish_renderer = _renderer(report, endpoint, False)
    finish = orjson.loads(finish_renderer.final(" b", "length", 3, report.timings(_finished(CACHED)))[len(b"data: ") :])
    assert ("timings" in finish) is (answer_format is not AnswerFormat.VLLM)
    assert dialect.read_chunk(token) == (True, None, (), False)
    assert dialect.read_chunk(finish) == (True, None, ("length",), False)


@dialects
def test_vllm_s_per_chunk_usage_is_read_as_it_came(dialect: Dialect, endpoint: Endpoint) -> None:
    """Continuous usage stats: every chunk's usage, without details; the very object, not a copy."""
    event = StreamRenderer(endpoint, "id-1", "m", 1, True, continuous_prompt=PROMPT).content(" a", 2)
    chunk = orjson.loads(event[len(b"data: ") :])
    output, usage, _, _ = dialect.read_chunk(chunk)
    assert output
    assert usage is chunk["usage"]
    assert _cached(usage) is None


# llama.cpp's shapes as its server writes them (tools/server/server-task.cpp): usage_json_oaicompat
# and result_timings::to_json, before and after PR #19361.
TIMINGS = {
    "cache_n": 512,
    "prompt_n": 13,
    "prompt_ms": 250.3,
    "prompt_per_token_ms": 19.2,
    "prompt_per_second": 51.9,
    "predicted_n": 4,
    "predicted_ms": 165.6,
    "predicted_per_token_ms": 55.2,
    "predicted_per_second": 18.1,
}
LEGACY_USAGE = {"completion_tokens": 4, "prompt_tokens": 525, "total_tokens": 529}


def test_llamacpp_legacy_answers_as_its_server_writes_them() -> None:
    whole: dict[str, Any] = {
        "choices": [{"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": "Hi"}}],
        "created": 1,
        "model": "m",
        "system_fingerprint": "b5000",
        "object": "chat.completion",
        "usage": dict(LEGACY_USAGE),
        "id": "chatcmpl-1",
        "timings": dict(TIMINGS),
    }
    usage = CHAT.answer_usage(whole)
    assert usage == {**LEGACY_USAGE, "prompt_tokens_details": {"cached_tokens": 512}}
    assert "prompt_tokens_details" not in whole["usage"]
    chunk: dict[str, Any] = {
        "choices": [],
        "created": 1,
        "id": "chatcmpl-1",
        "model": "m",
        "object": "chat.completion.chunk",
    }
    _, streamed, _, usage_only = CHAT.read_chunk({**chunk, "usage": dict(LEGACY_USAGE), "timings": dict(TIMINGS)})
    assert usage_only
    assert _cached(streamed) == 512


@pytest.mark.parametrize(
    ("usage", "timings", "cached"),
    [
        ({**LEGACY_USAGE, "prompt_tokens_details": {"cached_tokens": 7}}, TIMINGS, 7),  # llama.cpp's own count wins
        ({**LEGACY_USAGE, "prompt_tokens_details": None}, TIMINGS, 512),
        ({**LEGACY_USAGE, "prompt_tokens_details": {"cached_tokens": None, "audio_tokens": 2}}, TIMINGS, 512),
        (LEGACY_USAGE, {**TIMINGS, "cache_n": "512"}, None),
        (LEGACY_USAGE, {**TIMINGS, "cache_n": True}, None),
        (LEGACY_USAGE, None, None),
        (LEGACY_USAGE, [512], None),
    ],
    ids=["details-win", "null-details", "null-count-other-details-kept", "string", "bool", "null-timings", "list"],
)
def test_cache_n_fills_only_a_missing_count(usage: dict[str, Any], timings: Any, cached: int | None) -> None:
    chunk = {"id": "x", "choices": [], "usage": copy.deepcopy(usage), "timings": timings}
    _, read, _, _ = CHAT.read_chunk(chunk)
    whole = CHAT.answer_usage({"id": "x", "choices": [], "usage": copy.deepcopy(usage), "timings": timings})
    assert _cached(read) == _cached(whole) == cached
    assert chunk["usage"] == usage
    if cached == 512 and isinstance(usage.get("prompt_tokens_details"), dict):
        assert read is not None
        assert read["prompt_tokens_details"]["audio_tokens"] == 2
