"""Per-chunk usage the gateway asked for is cut out of a chunk's bytes, or the chunk is re-serialised.

The byte cut is only taken when it is exact; the chunks come from the simulator's own renderer,
which writes vLLM's shape, and each result must parse to what removing the field would give.
"""

from __future__ import annotations

import orjson
import pytest

from gateway.pipeline.relay import _without_trailing_usage
from loadtests.sim.protocol import Endpoint, StreamRenderer


def content_chunk(endpoint: Endpoint) -> bytes:
    renderer = StreamRenderer(endpoint, "chatcmpl-1", "m", 1, include_usage=True, continuous_prompt=12)
    return renderer.content(" token", 3)


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETION])
@pytest.mark.parametrize("null", [False, True], ids=["removed", "set_to_null"])
def test_vllm_s_continuous_usage_is_cut_exactly(endpoint: Endpoint, null: bool) -> None:
    event = content_chunk(endpoint)
    document = orjson.loads(event[6:])
    assert document["usage"] == {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3}
    cut = _without_trailing_usage(event, null=null)
    assert cut is not None
    assert cut.startswith(b"data: ")
    assert cut.endswith(b"\n\n")
    expected = {k: v for k, v in document.items() if k != "usage"}
    if null:
        expected["usage"] = None
    assert orjson.loads(cut[6:]) == expected


@pytest.mark.parametrize(
    "payload",
    [
        {"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}},
        {"id": "x", "usage": {"prompt_tokens": 1}, "choices": [{"delta": {"content": "a"}}]},
        {"id": "x", "choices": [{"delta": {"content": ',"usage":{"a":1}}'}}]},
    ],
    ids=["nested usage", "usage not last", "the pattern inside a string"],
)
def test_anything_else_is_left_to_re_serialisation(payload: dict[str, object]) -> None:
    event = b"data: " + orjson.dumps(payload) + b"\n\n"
    assert _without_trailing_usage(event, null=False) is None
